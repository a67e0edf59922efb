// Compatibility check of Shoal's transaction mode with pgx v5 in its default
// cache-statement mode: many concurrent connections (more than the pool has servers) using
// prepared statements, transactions, errors and batches, verifying every result.
// Usage: go run . DSN [WORKERS]
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

func worker(ctx context.Context, dsn string, w, rounds int) error {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	// A session SET holds across transactions (which run on different servers).
	if _, err := conn.Exec(ctx, fmt.Sprintf("SET application_name = 'pgx-%d'", w)); err != nil {
		return err
	}
	for i := 0; i < rounds; i++ {
		k := w*10000 + i
		var v int
		if err := conn.QueryRow(ctx, "SELECT $1::int * 2", k).Scan(&v); err != nil || v != k*2 {
			return fmt.Errorf("cached statement: %v %d", err, v)
		}
		tx, err := conn.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "INSERT INTO compat_go (k, v) VALUES ($1, $2)", k, fmt.Sprintf("g%d", k)); err != nil {
			return err
		}
		var s string
		if err := tx.QueryRow(ctx, "SELECT v FROM compat_go WHERE k = $1", k).Scan(&s); err != nil || s != fmt.Sprintf("g%d", k) {
			return fmt.Errorf("read own write: %v %q", err, s)
		}
		if err := tx.Commit(ctx); err != nil {
			return err
		}
		_, err = conn.Exec(ctx, "INSERT INTO compat_go (k, v) VALUES ($1, $2)", k, "dup")
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "23505" {
			return fmt.Errorf("duplicate must fail with 23505, got %v", err)
		}
		batch := &pgx.Batch{}
		for j := 0; j < 5; j++ {
			batch.Queue("SELECT $1::int", k+j)
		}
		br := conn.SendBatch(ctx, batch)
		for j := 0; j < 5; j++ {
			var got int
			if err := br.QueryRow().Scan(&got); err != nil || got != k+j {
				br.Close()
				return fmt.Errorf("batch result %d: %v %d", j, err, got)
			}
		}
		if err := br.Close(); err != nil {
			return err
		}
		var app string
		if err := conn.QueryRow(ctx, "SELECT current_setting('application_name')").Scan(&app); err != nil || app != fmt.Sprintf("pgx-%d", w) {
			return fmt.Errorf("SET held: %v %q", err, app)
		}
	}
	// COPY FROM STDIN.
	rows := make([][]any, 40)
	for j := range rows {
		rows[j] = []any{5_000_000 + w*100 + j, "copied"}
	}
	n, err := conn.CopyFrom(ctx, pgx.Identifier{"compat_go"}, []string{"k", "v"}, pgx.CopyFromRows(rows))
	if err != nil || n != 40 {
		return fmt.Errorf("copy: %v %d", err, n)
	}
	// Cancel: a context deadline makes pgx send a CancelRequest.
	cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	_, err = conn.Exec(cctx, "SELECT pg_sleep(5)")
	cancel()
	if err == nil {
		return fmt.Errorf("cancel: pg_sleep was not interrupted")
	}
	if conn.IsClosed() {
		// pgx closes the connection when a context is cancelled mid-query; reconnect.
		conn, err = pgx.Connect(ctx, dsn)
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
	}
	var one int
	if err := conn.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil || one != 1 {
		return fmt.Errorf("after cancel: %v", err)
	}
	return nil
}

func main() {
	ctx := context.Background()
	dsn := os.Args[1]
	workers := 20
	if len(os.Args) > 2 {
		workers, _ = strconv.Atoi(os.Args[2])
	}
	rounds := 15
	setup, err := pgx.Connect(ctx, dsn)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if _, err := setup.Exec(ctx, "CREATE TABLE IF NOT EXISTS compat_go (k int PRIMARY KEY, v text)"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	setup.Close(ctx)
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			if err := worker(ctx, dsn, w, rounds); err != nil {
				errs <- fmt.Errorf("worker %d: %w", w, err)
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Printf("pgx v5: %d workers x %d rounds OK\n", workers, rounds)
}
