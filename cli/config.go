package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/txlimit/txlimit/ratelimit"
)

// LimitJSON is one limit in a file read by LoadLimits: the fields of ratelimit.Config, with
// durations as Go duration strings ("1m", "24h") and times in RFC 3339.
type LimitJSON struct {
	// Kind is "token-bucket" or "fixed-window". Defaults to "token-bucket".
	Kind string `json:"kind,omitempty"`
	// Rate is Config.Rate. Required.
	Rate float64 `json:"rate"`
	// Period is Config.Period, e.g. "1m". Required.
	Period string `json:"period"`
	// Capacity is Config.Capacity. Defaults to 0: Rate.
	Capacity float64 `json:"capacity,omitempty"`
	// MaxReserved is Config.MaxReserved. Defaults to 0 (see Config.MaxReserved).
	MaxReserved float64 `json:"max_reserved,omitempty"`
	// Shards is Config.Shards. Defaults to 0: one shard.
	Shards int `json:"shards,omitempty"`
	// Start is Config.Start, RFC 3339. Defaults to "": the zero time.
	Start string `json:"start,omitempty"`
}

// readLimits reads the JSON object of LoadLimits entry by entry, and each entry field by field, so
// that a name or a field given twice is an error (encoding/json keeps the last), as are anything
// but one object (null among it), an entry that is not an object, and a field whose name is not
// one of LimitJSON's exactly (encoding/json would match "Rate" or "RATE" to "rate").
func readLimits(r io.Reader) (map[string]LimitJSON, error) {
	dec := json.NewDecoder(r)
	if tok, err := dec.Token(); err != nil {
		return nil, fmt.Errorf("limits: %w", err)
	} else if tok != json.Delim('{') {
		return nil, fmt.Errorf("limits: want a JSON object of named limits, got %v", tok)
	}
	raw := map[string]LimitJSON{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, fmt.Errorf("limits: %w", err)
		}
		name := tok.(string) // an object's keys are strings: the decoder checks it
		if _, dup := raw[name]; dup {
			return nil, fmt.Errorf("limits: %q is defined twice", name)
		}
		l, err := readLimit(dec)
		if err != nil {
			return nil, fmt.Errorf("limits: %q: %w", name, err)
		}
		raw[name] = l
	}
	if _, err := dec.Token(); err != nil { // the object's closing brace
		return nil, fmt.Errorf("limits: %w", err)
	}
	if _, err := dec.Token(); err != io.EOF { // one object, then nothing but white space
		return nil, errors.New("limits: malformed JSON: more after the object")
	}
	return raw, nil
}

// readLimit reads one entry of readLimits: an object of LimitJSON's fields, each at most once.
func readLimit(dec *json.Decoder) (LimitJSON, error) {
	var l LimitJSON
	tok, err := dec.Token()
	if err != nil {
		return l, err
	}
	if tok != json.Delim('{') {
		if tok == nil {
			tok = "null"
		}
		return l, fmt.Errorf("want an object, got %v", tok)
	}
	fields := map[string]any{
		"kind": &l.Kind, "rate": &l.Rate, "period": &l.Period, "capacity": &l.Capacity,
		"max_reserved": &l.MaxReserved, "shards": &l.Shards, "start": &l.Start,
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return l, err
		}
		field := tok.(string) // an object's keys are strings: the decoder checks it
		dst, ok := fields[field]
		if !ok {
			return l, fmt.Errorf("unknown field %q", field)
		}
		if seen[field] {
			return l, fmt.Errorf("field %q is given twice", field)
		}
		seen[field] = true
		if err := dec.Decode(dst); err != nil {
			return l, fmt.Errorf("%s: %w", field, err)
		}
	}
	_, err = dec.Token() // the entry's closing brace
	return l, err
}

// LoadLimits reads a JSON object of named limits, the format of --config, so that an application
// and the command read the same definitions:
//
//	{
//	  "sendMessage": {"rate": 10, "period": "1m", "capacity": 3},
//	  "llm-tokens":  {"rate": 100000, "period": "1h", "max_reserved": 50000, "shards": 4},
//	  "daily":       {"kind": "fixed-window", "rate": 1000, "period": "24h", "start": "2026-01-01T00:00:00Z"}
//	}
//
// Unknown fields (names are matched exactly), a name or a field given twice and anything but one
// object are errors. Each config is validated as ratelimit.New validates it: an invalid one is a
// *ratelimit.ConfigError (errors.Is(err, ratelimit.ErrInvalid)); malformed JSON or a malformed
// duration or time is a plain error.
func LoadLimits(r io.Reader) (map[string]ratelimit.Config, error) {
	raw, err := readLimits(r)
	if err != nil {
		return nil, err
	}
	out := make(map[string]ratelimit.Config, len(raw))
	for name, l := range raw {
		cfg := ratelimit.Config{Rate: l.Rate, Capacity: l.Capacity, MaxReserved: l.MaxReserved, Shards: l.Shards}
		k, err := parseKind(l.Kind)
		if err != nil {
			return nil, fmt.Errorf("limits: %q: %w", name, err)
		}
		cfg.Kind = k
		if l.Period == "" {
			return nil, fmt.Errorf("limits: %q: period is required, e.g. \"1m\"", name)
		}
		if cfg.Period, err = time.ParseDuration(l.Period); err != nil {
			return nil, fmt.Errorf("limits: %q: period: %w", name, err)
		}
		if l.Start != "" {
			if cfg.Start, err = time.Parse(time.RFC3339Nano, l.Start); err != nil {
				return nil, fmt.Errorf("limits: %q: start: %w", name, err)
			}
		}
		out[name] = cfg
	}
	if _, err := ratelimit.New(&ratelimit.LimiterConfig{Limits: out}); err != nil {
		return nil, err
	}
	return out, nil
}
