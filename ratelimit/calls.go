package ratelimit

import (
	"fmt"
	"slices"
)

// call is one caller's decision, validated and resolved: a group of requests decided all or
// nothing (a single Limit, LimitN, Check or CheckN is a group of one). The engine decides a list
// of calls in list order, each as if the calls before it had run one by one.
//
// A call holds nothing of its caller's (the Batcher may decide it after its caller has left, and the
// caller may then reuse its []Request): what the engine reads of each request is in specs and asks.
type call struct {
	op     string
	dry    bool
	single bool // Limit/LimitN/Check/CheckN: the caller's Result is Results[0]
	specs  []spec
	asks   []ask
}

// ask is what one request of a call asks for: its count (a Request's 0 made 1) and its Reserve.
type ask struct {
	count   float64
	reserve bool
}

// outcome is what the engine decided for one call: its result, or an error of its own (a
// *BusyError) that leaves the other calls of the list unaffected.
type outcome struct {
	res ManyResult
	err error
}

// metricOp is the txlimit.op attribute of a call's metrics (metrics.go): Limit and Check count as
// LimitN and CheckN, the calls they are shorthand for, so the attribute keeps its four values,
// while errors name the call that was made (op: "ratelimit: Limit: ...").
func metricOp(op string) string {
	switch op {
	case "Limit":
		return "LimitN"
	case "Check":
		return "CheckN"
	}
	return op
}

// prepareCall validates a call of op over reqs. Nothing is sent to the database. A single call
// (Limit, LimitN, Check, CheckN) is one request whose count is checked first and has no default.
func (l *Limiter) prepareCall(op string, reqs []Request, single, dry bool) (*call, error) {
	if len(reqs) == 0 {
		return nil, &ArgumentError{Op: op, Arg: "requests", Reason: "must not be empty"}
	}
	if single {
		if err := checkCount(op, reqs[0].Count); err != nil {
			return nil, err
		}
	}
	c := &call{op: op, dry: dry, single: single, specs: make([]spec, len(reqs)), asks: make([]ask, len(reqs))}
	var seen map[[2]string]bool // past a few requests; fewer are compared pairwise
	if len(reqs) > 8 {
		seen = make(map[[2]string]bool, len(reqs))
	}
	for i, r := range reqs {
		s, err := l.resolve(op, r.Name, r.Key, r.Config)
		if err != nil {
			return nil, err
		}
		twice := seen[[2]string{r.Name, r.Key}]
		if seen == nil {
			twice = slices.ContainsFunc(reqs[:i], func(q Request) bool { return q.Name == r.Name && q.Key == r.Key })
		}
		if twice {
			return nil, &ArgumentError{Op: op, Arg: "requests", Reason: fmt.Sprintf("name %q key %q appears twice", r.Name, r.Key)}
		}
		if seen != nil {
			seen[[2]string{r.Name, r.Key}] = true
		}
		c.asks[i] = ask{count: r.Count, reserve: r.Reserve}
		if c.asks[i].count == 0 {
			c.asks[i].count = 1
		}
		if err := s.checkRequest(op, c.asks[i].count, r.Reserve); err != nil {
			return nil, err
		}
		c.specs[i] = s
	}
	return c, nil
}
