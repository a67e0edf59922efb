//! The admin console's commands, parsed from query text (pure).

/// One console command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    Show(String),
    Pause(Option<String>),
    Resume(Option<String>),
    Suspend,
    Reload,
    Kill(String),
    Shutdown,
    WaitClose(Option<String>),
    /// Replace every server of a database (or all) as it is released.
    Reconnect(Option<String>),
    /// Refuse (`Disable`) or accept again (`Enable`) new logins to a database.
    Disable(String),
    Enable(String),
    /// PgBouncer's `SET key = value`: refused with how Shoal changes settings.
    Set(String),
    /// Empty text (`;` alone).
    Empty,
}

impl Command {
    /// Whether a `stats_users` member may run it.
    pub fn read_only(&self) -> bool {
        matches!(self, Command::Show(_) | Command::Empty)
    }
}

/// Parses one statement (no `;`). Names may be quoted with `"`.
pub fn parse(text: &str) -> Result<Command, String> {
    let words: Vec<&str> = text.split_whitespace().collect();
    let arg = |i: usize| -> Option<String> {
        words
            .get(i)
            .map(|w| w.trim_matches('"').to_owned())
            .filter(|w| !w.is_empty())
    };
    let Some(first) = words.first() else {
        return Ok(Command::Empty);
    };
    let cmd = match first.to_ascii_uppercase().as_str() {
        "SHOW" => Command::Show(
            arg(1)
                .ok_or("SHOW needs a subject, e.g. SHOW POOLS (SHOW HELP lists them)")?
                .to_ascii_uppercase(),
        ),
        "PAUSE" => Command::Pause(arg(1)),
        "RESUME" => Command::Resume(arg(1)),
        "SUSPEND" => Command::Suspend,
        "RELOAD" => Command::Reload,
        "KILL" => Command::Kill(arg(1).ok_or("KILL needs a database name")?),
        "SHUTDOWN" => Command::Shutdown,
        "WAIT_CLOSE" => Command::WaitClose(arg(1)),
        "RECONNECT" => Command::Reconnect(arg(1)),
        "DISABLE" => Command::Disable(arg(1).ok_or("DISABLE needs a database name")?),
        "ENABLE" => Command::Enable(arg(1).ok_or("ENABLE needs a database name")?),
        "SET" => return Ok(Command::Set(text.trim().to_owned())),
        other => {
            return Err(format!(
                "unknown admin console command \"{other}\": SHOW HELP lists the commands"
            ))
        }
    };
    let max = match cmd {
        Command::Suspend | Command::Reload | Command::Shutdown => 1,
        _ => 2,
    };
    if words.len() > max {
        return Err(format!("too many words in \"{}\"", text.trim()));
    }
    Ok(cmd)
}

/// Splits query text into statements at `;` outside quotes.
pub fn statements(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut quote: Option<char> = None;
    for (i, c) in text.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (None, '"' | '\'') => quote = Some(c),
            (None, ';') => {
                out.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if !text[start..].trim().is_empty() || out.is_empty() {
        out.push(&text[start..]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_commands() {
        assert_eq!(parse("show pools").unwrap(), Command::Show("POOLS".into()));
        assert_eq!(
            parse("PAUSE app").unwrap(),
            Command::Pause(Some("app".into()))
        );
        assert_eq!(parse("pause").unwrap(), Command::Pause(None));
        assert_eq!(
            parse("KILL \"tenant:acme\"").unwrap(),
            Command::Kill("tenant:acme".into())
        );
        assert_eq!(parse("  ").unwrap(), Command::Empty);
        assert!(parse("KILL").is_err());
        assert!(parse("DROP TABLE x").is_err());
        assert!(parse("RELOAD now").is_err());
        assert!(parse("SHOW").is_err());
        assert_eq!(parse("reconnect").unwrap(), Command::Reconnect(None));
        assert_eq!(
            parse("DISABLE app").unwrap(),
            Command::Disable("app".into())
        );
        assert!(parse("ENABLE").is_err());
        assert!(matches!(
            parse("SET default_pool_size = 5").unwrap(),
            Command::Set(_)
        ));
        assert!(Command::Show("STATS".into()).read_only());
        assert!(!Command::Reload.read_only());
    }

    #[test]
    fn splits_statements() {
        assert_eq!(
            statements("SHOW POOLS; SHOW STATS;"),
            vec!["SHOW POOLS", " SHOW STATS"]
        );
        assert_eq!(statements("SHOW VERSION"), vec!["SHOW VERSION"]);
        assert_eq!(statements("KILL \"a;b\""), vec!["KILL \"a;b\""]);
        assert_eq!(statements(""), vec![""]);
    }
}
