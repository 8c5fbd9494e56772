package ratelimit

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// SQLQuerier is what SQL needs of a database/sql handle: *sql.DB, *sql.Conn and *sql.Tx have both
// methods, and so do the handles of libraries built on them (sqlx.DB and sqlx.Tx embed them; GORM's
// db.DB() and bun's DB give a *sql.DB; a GORM or bun transaction wraps a *sql.Tx).
type SQLQuerier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// SQL adapts a database/sql handle to an Executor, so that applications on database/sql can pass
// their own *sql.Tx to every call of this package: the limit's writes then commit or roll back
// with the transaction, as with a pgx.Tx. A *sql.DB or *sql.Conn makes a decision of its own.
//
// The driver must speak to Postgres: the pgx stdlib driver (github.com/jackc/pgx/v5/stdlib) and
// lib/pq (github.com/lib/pq) are tested. Arguments that database/sql cannot pass as they are
// (slices other than []byte, arrays, maps) are sent as Postgres text literals, encoded by pgx's
// type map (pgtype.Map) for the Postgres type of the Go value, e.g. []string as text[]; the
// statement casts them to their type, as every statement of this package does. Scan destinations
// that database/sql cannot fill (slices, arrays, maps, structs without a Scan method) are decoded
// from the column's text the same way; sql.Scanner destinations, pgtype values among them, scan
// themselves. Errors with an SQLSTATE (lib/pq's *pq.Error, pgx's *pgconn.PgError) also match
// *pgconn.PgError under errors.As, so IsRetryable and the SQLSTATE checks of this package work
// with either driver; sql.ErrNoRows becomes pgx.ErrNoRows. A nil db gives a nil Executor, which
// every call refuses with an *ArgumentError.
//
// What database/sql cannot tell is filled in as well as it can be: the CommandTag of an Exec
// carries RowsAffected and the statement's first keyword; Rows.Conn, RawValues and the OIDs of
// FieldDescriptions are zero.
func SQL(db SQLQuerier) Executor {
	if db == nil {
		return nil
	}
	if v := reflect.ValueOf(db); v.Kind() == reflect.Pointer && v.IsNil() {
		return nil
	}
	return &sqlExecutor{db: db}
}

// sqlExecutor implements Executor over database/sql.
type sqlExecutor struct {
	db SQLQuerier
}

// newTypes returns the type map that encodes the arguments or decodes the rows of one statement.
// A pgtype.Map caches plans and is not safe for concurrent use, while an Executor is; a map per
// statement costs little next to a round trip.
func newTypes() *pgtype.Map { return pgtype.NewMap() }

func (e *sqlExecutor) Exec(ctx context.Context, query string, args ...any) (pgconn.CommandTag, error) {
	a, err := sqlArgs(args)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	res, err := e.db.ExecContext(ctx, query, a...)
	if err != nil {
		return pgconn.CommandTag{}, sqlError(err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return pgconn.CommandTag{}, sqlError(err)
	}
	return commandTag(query, n), nil
}

func (e *sqlExecutor) Query(ctx context.Context, query string, args ...any) (pgx.Rows, error) {
	a, err := sqlArgs(args)
	if err != nil {
		return nil, err
	}
	rows, err := e.db.QueryContext(ctx, query, a...)
	if err != nil {
		return nil, sqlError(err)
	}
	return &sqlRows{rows: rows, types: newTypes(), verb: firstKeyword(query)}, nil
}

func (e *sqlExecutor) QueryRow(ctx context.Context, query string, args ...any) pgx.Row {
	rows, err := e.Query(ctx, query, args...)
	return &sqlRow{rows: rows, err: err}
}

// sqlArgs converts the arguments database/sql cannot pass as they are into text literals.
func sqlArgs(args []any) ([]any, error) {
	var out []any
	var m *pgtype.Map
	for i, a := range args {
		if !needsText(a) {
			continue
		}
		if out == nil {
			out = append([]any(nil), args...)
			m = newTypes()
		}
		s, err := textLiteral(m, a)
		if err != nil {
			return nil, fmt.Errorf("ratelimit: SQL: argument $%d (%T): %w", i+1, a, err)
		}
		out[i] = s
	}
	if out == nil {
		return args, nil
	}
	return out, nil
}

// needsText reports whether database/sql's default conversion would refuse a (a slice other than
// []byte, an array, a map); driver.Valuer and sql's own types are passed as they are.
func needsText(a any) bool {
	if a == nil {
		return false
	}
	if _, ok := a.(driver.Valuer); ok {
		return false
	}
	switch reflect.TypeOf(a).Kind() {
	case reflect.Slice:
		_, isBytes := a.([]byte)
		return !isBytes
	case reflect.Array, reflect.Map:
		return true
	}
	return false
}

// textLiteral encodes a as the text form of the Postgres type pgx maps its Go type to. A nil slice
// is NULL, as pgx sends it.
func textLiteral(m *pgtype.Map, a any) (any, error) {
	t, ok := m.TypeForValue(a)
	if !ok {
		return nil, errors.New("no Postgres type for this Go type in pgx's type map")
	}
	buf, err := m.Encode(t.OID, pgtype.TextFormatCode, a, nil)
	if err != nil {
		return nil, err
	}
	if buf == nil {
		return nil, nil
	}
	return string(buf), nil
}

// sqlError makes an error carrying an SQLSTATE (lib/pq's) also a *pgconn.PgError under errors.As,
// and sql.ErrNoRows pgx.ErrNoRows.
func sqlError(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, sql.ErrNoRows) {
		return pgx.ErrNoRows
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return err
	}
	var coded interface{ SQLState() string }
	if !errors.As(err, &coded) {
		return err
	}
	pe := &pgconn.PgError{Code: coded.SQLState(), Message: err.Error()}
	var fields interface{ Get(k byte) string }
	if errors.As(err, &fields) {
		pe.Severity, pe.Message, pe.Detail, pe.Hint = fields.Get('S'), fields.Get('M'), fields.Get('D'), fields.Get('H')
		pe.ConstraintName, pe.TableName, pe.SchemaName = fields.Get('n'), fields.Get('t'), fields.Get('s')
	}
	return &driverError{err: err, pg: pe}
}

// driverError is a driver's error that also reads as a *pgconn.PgError.
type driverError struct {
	err error
	pg  *pgconn.PgError
}

func (e *driverError) Error() string   { return e.err.Error() }
func (e *driverError) Unwrap() []error { return []error{e.err, e.pg} }

// firstKeyword returns the statement's first SQL keyword in upper case, after comments and
// parentheses, e.g. "WITH", "SELECT", "UPDATE".
func firstKeyword(query string) string {
	s := query
	for {
		s = strings.TrimLeft(s, " \t\r\n(")
		switch {
		case strings.HasPrefix(s, "--"):
			i := strings.IndexByte(s, '\n')
			if i < 0 {
				return ""
			}
			s = s[i+1:]
		case strings.HasPrefix(s, "/*"):
			i := strings.Index(s, "*/")
			if i < 0 {
				return ""
			}
			s = s[i+2:]
		default:
			end := strings.IndexFunc(s, func(r rune) bool { return !('a' <= r && r <= 'z' || 'A' <= r && r <= 'Z') })
			if end < 0 {
				end = len(s)
			}
			return strings.ToUpper(s[:end])
		}
	}
}

// commandTag builds a tag that Postgres would send for n rows, as far as the query's first keyword
// tells the verb: RowsAffected is always n.
func commandTag(query string, n int64) pgconn.CommandTag {
	verb := firstKeyword(query)
	switch verb {
	case "INSERT":
		return pgconn.NewCommandTag(fmt.Sprintf("INSERT 0 %d", n))
	case "":
		verb = "EXEC"
	}
	return pgconn.NewCommandTag(fmt.Sprintf("%s %d", verb, n))
}

// sqlRows implements pgx.Rows over *sql.Rows.
type sqlRows struct {
	rows   *sql.Rows
	types  *pgtype.Map
	verb   string
	n      int64
	err    error
	closed bool
	fields []pgconn.FieldDescription
}

func (r *sqlRows) Close() {
	if r.closed {
		return
	}
	r.closed = true
	if err := r.rows.Close(); err != nil && r.err == nil {
		r.err = sqlError(err)
	}
	if err := r.rows.Err(); err != nil && r.err == nil {
		r.err = sqlError(err)
	}
}

func (r *sqlRows) Err() error { return r.err }

func (r *sqlRows) CommandTag() pgconn.CommandTag {
	verb := r.verb
	if verb == "" || verb == "WITH" {
		verb = "SELECT"
	}
	return commandTag(verb, r.n)
}

func (r *sqlRows) FieldDescriptions() []pgconn.FieldDescription {
	if r.fields != nil || r.closed {
		return r.fields
	}
	cols, err := r.rows.Columns()
	if err != nil {
		return nil
	}
	r.fields = make([]pgconn.FieldDescription, len(cols))
	for i, c := range cols {
		r.fields[i] = pgconn.FieldDescription{Name: c, Format: pgtype.TextFormatCode}
	}
	return r.fields
}

func (r *sqlRows) Next() bool {
	if r.closed {
		return false
	}
	r.FieldDescriptions() // Columns is unavailable once the rows are closed
	if r.rows.Next() {
		r.n++
		return true
	}
	r.Close()
	return false
}

func (r *sqlRows) Scan(dest ...any) error {
	wrapped := make([]any, len(dest))
	for i, d := range dest {
		wrapped[i] = scanTarget(r.types, d)
	}
	if err := r.rows.Scan(wrapped...); err != nil {
		err = sqlError(err)
		if r.err == nil {
			r.err = err
		}
		r.Close()
		return err
	}
	return nil
}

func (r *sqlRows) Values() ([]any, error) {
	cols, err := r.rows.ColumnTypes()
	if err != nil {
		return nil, sqlError(err)
	}
	vals := make([]any, len(cols))
	ptrs := make([]any, len(cols))
	for i := range vals {
		ptrs[i] = &vals[i]
	}
	if err := r.rows.Scan(ptrs...); err != nil {
		return nil, sqlError(err)
	}
	for i, v := range vals {
		if b, ok := v.([]byte); ok && cols[i].DatabaseTypeName() != "BYTEA" {
			vals[i] = string(b) // lib/pq returns text as bytes; pgx would decode it
		}
	}
	return vals, nil
}

// RawValues returns nil: database/sql does not expose the wire bytes.
func (r *sqlRows) RawValues() [][]byte { return nil }

// Conn returns nil: there is no *pgx.Conn behind database/sql.
func (r *sqlRows) Conn() *pgx.Conn { return nil }

func (r *sqlRows) TypeMap() *pgtype.Map { return r.types }

// scanTarget returns d itself when database/sql can scan into it, else a scanner that decodes the
// column's text with pgx's type map for d's Go type.
func scanTarget(m *pgtype.Map, d any) any {
	if d == nil {
		return d
	}
	if _, ok := d.(sql.Scanner); ok {
		return d
	}
	v := reflect.ValueOf(d)
	if v.Kind() != reflect.Pointer || v.IsNil() {
		return d
	}
	switch v.Elem().Kind() {
	case reflect.Slice:
		if v.Elem().Type().Elem().Kind() == reflect.Uint8 {
			return d // []byte, sql.RawBytes
		}
	case reflect.Array, reflect.Map:
	case reflect.Struct:
		if _, isTime := d.(*time.Time); isTime {
			return d
		}
	default:
		return d
	}
	return &textScanner{types: m, dst: d}
}

// textScanner decodes a column's text (or a value the driver already decoded) into dst.
type textScanner struct {
	types *pgtype.Map
	dst   any
}

func (s *textScanner) Scan(src any) error {
	t, ok := s.types.TypeForValue(reflect.ValueOf(s.dst).Elem().Interface())
	if !ok {
		return fmt.Errorf("ratelimit: SQL: cannot scan into %T: no Postgres type for it in pgx's type map", s.dst)
	}
	switch v := src.(type) {
	case nil:
		return s.types.Scan(t.OID, pgtype.TextFormatCode, nil, s.dst)
	case []byte:
		return s.types.Scan(t.OID, pgtype.TextFormatCode, v, s.dst)
	case string:
		return s.types.Scan(t.OID, pgtype.TextFormatCode, []byte(v), s.dst)
	}
	dv := reflect.ValueOf(s.dst).Elem()
	if sv := reflect.ValueOf(src); sv.Type().AssignableTo(dv.Type()) {
		dv.Set(sv)
		return nil
	}
	return fmt.Errorf("ratelimit: SQL: cannot scan %T into %T", src, s.dst)
}

// sqlRow implements pgx.Row: the first row of a query, which is closed after Scan.
type sqlRow struct {
	rows pgx.Rows
	err  error
}

func (r *sqlRow) Scan(dest ...any) error {
	if r.err != nil {
		return r.err
	}
	defer r.rows.Close()
	if !r.rows.Next() {
		if err := r.rows.Err(); err != nil {
			return err
		}
		return pgx.ErrNoRows
	}
	if err := r.rows.Scan(dest...); err != nil {
		return err
	}
	r.rows.Close()
	return r.rows.Err()
}
