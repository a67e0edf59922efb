// Compatibility check of Shoal's transaction mode with pgJDBC (prepareThreshold=1: every
// PreparedStatement becomes a named server-side statement from its first use): many
// concurrent connections (more than the pool has servers) using prepared statements,
// transactions, errors and batches, verifying every result.
// Usage: java -cp lib/postgresql.jar Compat.java JDBC_URL USER PASSWORD [WORKERS]
import java.sql.*;
import java.util.*;
import java.util.concurrent.*;

public class Compat {
    static void check(boolean cond, String what) {
        if (!cond) throw new AssertionError(what);
    }

    static void worker(String url, Properties props, int w, int rounds) throws Exception {
        try (Connection c = DriverManager.getConnection(url, props)) {
            PreparedStatement dbl = c.prepareStatement("SELECT ?::int * 2");
            PreparedStatement ins = c.prepareStatement("INSERT INTO compat_jdbc (k, v) VALUES (?, ?)");
            PreparedStatement sel = c.prepareStatement("SELECT v FROM compat_jdbc WHERE k = ?");
            for (int i = 0; i < rounds; i++) {
                int k = w * 10000 + i;
                dbl.setInt(1, k);
                try (ResultSet rs = dbl.executeQuery()) {
                    check(rs.next() && rs.getInt(1) == k * 2, "prepared select");
                }
                c.setAutoCommit(false);
                ins.setInt(1, k);
                ins.setString(2, "j" + k);
                ins.executeUpdate();
                sel.setInt(1, k);
                try (ResultSet rs = sel.executeQuery()) {
                    check(rs.next() && rs.getString(1).equals("j" + k), "read own write");
                }
                c.commit();
                c.setAutoCommit(true);
                try {
                    ins.setInt(1, k);
                    ins.setString(2, "dup");
                    ins.executeUpdate();
                    check(false, "duplicate must fail");
                } catch (SQLException e) {
                    check("23505".equals(e.getSQLState()), "unique violation, got " + e.getSQLState());
                }
                // A batch: several Bind/Execute before one Sync.
                PreparedStatement b = c.prepareStatement("INSERT INTO compat_jdbc (k, v) VALUES (?, 'batch')");
                for (int j = 1; j <= 5; j++) {
                    b.setInt(1, 1_000_000 + k * 10 + j);
                    b.addBatch();
                }
                int[] counts = b.executeBatch();
                check(counts.length == 5, "batch counts");
                b.close();
                if (i == 0) {
                    try (Statement s = c.createStatement()) {
                        s.execute("SET application_name = 'jdbc-" + w + "'");
                    }
                }
                try (Statement s = c.createStatement(); ResultSet rs = s.executeQuery("SELECT current_setting('application_name')")) {
                    check(rs.next() && rs.getString(1).equals("jdbc-" + w), "SET held");
                }
            }
            // COPY FROM STDIN through the CopyManager.
            org.postgresql.copy.CopyManager cm = c.unwrap(org.postgresql.PGConnection.class).getCopyAPI();
            StringBuilder data = new StringBuilder();
            for (int j = 0; j < 40; j++) data.append(5_000_000 + w * 100 + j).append("\tcopied\n");
            long copied = cm.copyIn("COPY compat_jdbc (k, v) FROM STDIN", new java.io.StringReader(data.toString()));
            check(copied == 40, "copy in");
            // Cancel: setQueryTimeout sends a CancelRequest.
            try (Statement s = c.createStatement()) {
                s.setQueryTimeout(1);
                s.execute("SELECT pg_sleep(10)");
                check(false, "query timeout must cancel");
            } catch (SQLException e) {
                check("57014".equals(e.getSQLState()), "query_canceled, got " + e.getSQLState());
            }
            try (Statement s = c.createStatement(); ResultSet rs = s.executeQuery("SELECT 1")) {
                check(rs.next() && rs.getInt(1) == 1, "goes on after cancel");
            }
        }
    }

    public static void main(String[] args) throws Exception {
        String url = args[0];
        Properties props = new Properties();
        props.setProperty("user", args[1]);
        props.setProperty("password", args[2]);
        props.setProperty("prepareThreshold", "1");
        int workers = args.length > 3 ? Integer.parseInt(args[3]) : 20;
        int rounds = 15;
        try (Connection c = DriverManager.getConnection(url, props); Statement s = c.createStatement()) {
            s.execute("CREATE TABLE IF NOT EXISTS compat_jdbc (k int PRIMARY KEY, v text)");
        }
        ExecutorService pool = Executors.newFixedThreadPool(workers);
        List<Future<?>> fs = new ArrayList<>();
        for (int w = 0; w < workers; w++) {
            final int ww = w;
            fs.add(pool.submit(() -> { worker(url, props, ww, rounds); return null; }));
        }
        try {
            for (Future<?> f : fs) f.get();
        } catch (ExecutionException e) {
            e.getCause().printStackTrace();
            System.exit(1);
        } finally {
            pool.shutdownNow();
        }
        System.out.println("pgJDBC " + org.postgresql.util.DriverInfo.DRIVER_VERSION + ": " + workers + " workers x " + rounds + " rounds OK");
    }
}
