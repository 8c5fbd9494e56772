package ratelimit

import (
	"context"
	"fmt"
)

// call is one caller's decision, validated and resolved: a group of requests decided all or
// nothing (a single Limit, LimitN, Check or CheckN is a group of one). The engine decides a list
// of calls in list order, each as if the calls before it had run one by one.
type call struct {
	op     string
	dry    bool
	single bool // Limit/LimitN/Check/CheckN: the caller's Result is Results[0]
	reqs   []Request
	specs  []spec
	counts []float64
}

// outcome is what the engine decided for one call: its result, or an error of its own (a
// *BusyError) that leaves the other calls of the list unaffected.
type outcome struct {
	res ManyResult
	err error
}

// prepareSingle validates a Limit, LimitN, Check or CheckN call. Nothing is sent to the database.
func (l *Limiter) prepareSingle(op, name, key string, count float64, opts *LimitOpts, dry bool) (*call, error) {
	if opts == nil {
		opts = &LimitOpts{}
	}
	if err := checkCount(op, count); err != nil {
		return nil, err
	}
	s, err := l.resolve(op, name, key, opts.Config)
	if err != nil {
		return nil, err
	}
	if err := s.checkRequest(op, count, opts.Reserve); err != nil {
		return nil, err
	}
	return &call{
		op: op, dry: dry, single: true,
		reqs:   []Request{{Name: name, Key: key, Count: count, Config: opts.Config, Reserve: opts.Reserve}},
		specs:  []spec{s},
		counts: []float64{count},
	}, nil
}

// prepareMany validates a LimitMany or CheckMany call. Nothing is sent to the database.
func (l *Limiter) prepareMany(op string, reqs []Request, dry bool) (*call, error) {
	if len(reqs) == 0 {
		return nil, &ArgumentError{Op: op, Arg: "requests", Reason: "must not be empty"}
	}
	c := &call{op: op, dry: dry, reqs: reqs, specs: make([]spec, len(reqs)), counts: make([]float64, len(reqs))}
	seen := make(map[[2]string]bool, len(reqs))
	for i, r := range reqs {
		s, err := l.resolve(op, r.Name, r.Key, r.Config)
		if err != nil {
			return nil, err
		}
		if seen[[2]string{r.Name, r.Key}] {
			return nil, &ArgumentError{Op: op, Arg: "requests", Reason: fmt.Sprintf("name %q key %q appears twice", r.Name, r.Key)}
		}
		seen[[2]string{r.Name, r.Key}] = true
		c.counts[i] = r.Count
		if c.counts[i] == 0 {
			c.counts[i] = 1
		}
		if err := s.checkRequest(op, c.counts[i], r.Reserve); err != nil {
			return nil, err
		}
		c.specs[i] = s
	}
	return c, nil
}

// decideCalls decides calls in list order and returns one outcome per call. An error returned
// alone (a database error) fails every call: nothing of the list is granted.
//
// For now each call is its own statement; the engine will decide the whole list in one.
func (l *Limiter) decideCalls(ctx context.Context, db Executor, calls []*call) ([]outcome, error) {
	out := make([]outcome, len(calls))
	for i, c := range calls {
		if c.single {
			r, err := l.one(ctx, db, c.op, c.reqs[0].Name, c.reqs[0].Key, c.counts[0], &LimitOpts{Config: c.reqs[0].Config, Reserve: c.reqs[0].Reserve}, c.dry)
			if err != nil {
				if _, busy := err.(*BusyError); busy {
					out[i].err = err
					continue
				}
				return nil, err
			}
			out[i].res = ManyResult{OK: r.OK, RetryAt: r.RetryAt, Results: []Result{r}, Time: r.Time}
			continue
		}
		r, err := l.many(ctx, db, c.op, c.reqs, c.dry)
		if err != nil {
			return nil, err
		}
		out[i].res = r
	}
	return out, nil
}
