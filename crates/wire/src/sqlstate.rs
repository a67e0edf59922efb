//! SQLSTATE codes Shoal sends in its own ErrorResponses, named as in PostgreSQL's appendix A.

pub const PROTOCOL_VIOLATION: &str = "08P01";
pub const CONNECTION_FAILURE: &str = "08006";
pub const CONNECTION_EXCEPTION: &str = "08000";
/// sqlserver_rejected_establishment_of_sqlconnection: a banned tenant.
pub const CONNECTION_REJECTED: &str = "08004";
pub const FEATURE_NOT_SUPPORTED: &str = "0A000";
pub const INVALID_AUTHORIZATION: &str = "28000";
pub const INVALID_PASSWORD: &str = "28P01";
pub const INSUFFICIENT_PRIVILEGE: &str = "42501";
pub const CONFIG_FILE_ERROR: &str = "F0000";
pub const INVALID_CATALOG_NAME: &str = "3D000";
pub const TOO_MANY_CONNECTIONS: &str = "53300";
pub const CONFIGURATION_LIMIT_EXCEEDED: &str = "53400";
pub const QUERY_CANCELED: &str = "57014";
pub const ADMIN_SHUTDOWN: &str = "57P01";
pub const CANNOT_CONNECT_NOW: &str = "57P03";
pub const INVALID_PARAMETER_VALUE: &str = "22023";
/// Also PostgreSQL's code for an invalid byte sequence in the client's encoding.
pub const CHARACTER_NOT_IN_REPERTOIRE: &str = "22021";
pub const PROGRAM_LIMIT_EXCEEDED: &str = "54000";
pub const IDLE_SESSION_TIMEOUT: &str = "57P05";
pub const INTERNAL_ERROR: &str = "XX000";
pub const INVALID_SQL_STATEMENT_NAME: &str = "26000";
pub const DUPLICATE_PREPARED_STATEMENT: &str = "42P05";
pub const IN_FAILED_SQL_TRANSACTION: &str = "25P02";
pub const READ_ONLY_SQL_TRANSACTION: &str = "25006";
pub const OBJECT_NOT_IN_PREREQUISITE_STATE: &str = "55000";
pub const OUT_OF_MEMORY: &str = "53200";
