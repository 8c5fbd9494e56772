package main

import (
	"context"
	"fmt"
	"slices"
	"time"
)

// pairedIDs are the contenders of the side-by-side latency comparison: the library on the pool,
// batched and not, and the floor they are held to.
var pairedIDs = []string{"txlimit", "txlimit-batched", "floor"}

// Paired is one contender's latency at 1 caller in the side-by-side comparison.
type Paired struct {
	Def    *Def
	Limit  Limit
	P50    time.Duration
	N      int   // decisions measured
	Errors int   // decisions that failed (left out of P50)
	Err    error // the last of them
}

// RunPaired measures the latency of one caller's decisions with each contender of defs side by
// side: one caller decides once with each in turn, rounds times, on one key of lim per contender.
// The order rotates every round and runs backwards every other round, so each contender follows
// each other one as often. A failed decision is counted and left out; the run is bounded like a
// cell (a minute past a generous budget of 10 ms a decision). Whatever slows the machine down meanwhile (the disk's flush
// time above all, which moves from one second to the next) falls on all of them alike, so the
// ratios of their medians are steadier than those of the throughput cells, whose contenders take
// turns only slice by slice.
func RunPaired(ctx context.Context, defs []*Def, contenders map[string]Contender, lim Limit, rounds int) []*Paired {
	out := make([]*Paired, len(defs))
	lat := make([][]time.Duration, len(defs))
	for i, d := range defs {
		out[i] = &Paired{Def: d, Limit: lim}
		lat[i] = make([]time.Duration, 0, rounds)
	}
	ctx, cancel := context.WithTimeout(ctx, time.Duration(rounds*len(defs))*10*time.Millisecond+time.Minute)
	defer cancel()
	key := func(d *Def) string { return "paired/" + lim.Name + "/" + d.ID }
	for _, d := range defs { // warm-up: the row exists and the connection is open
		_, _ = contenders[d.ID].Decide(ctx, lim.Name, key(d))
	}
	n := len(defs)
	for round := 0; round < rounds && ctx.Err() == nil; round++ {
		for j := range n {
			i := (round + j) % n
			if round%2 == 1 {
				i = (round + n - j) % n
			}
			start := time.Now()
			if _, err := contenders[defs[i].ID].Decide(ctx, lim.Name, key(defs[i])); err != nil {
				out[i].Errors++
				out[i].Err = err
				continue
			}
			lat[i] = append(lat[i], time.Since(start))
		}
	}
	for i := range defs {
		out[i].N = len(lat[i])
		if len(lat[i]) > 0 {
			slices.Sort(lat[i])
			out[i].P50 = lat[i][len(lat[i])/2]
		}
	}
	return out
}

// pairedMarkdown is the report's section on the side-by-side comparison.
func (rep *Report) pairedMarkdown() string {
	if len(rep.Paired) == 0 {
		return ""
	}
	w := func(format string, args ...any) string { return fmt.Sprintf(format, args...) }
	s := w("\n## Latency at 1 caller, side by side (p50)\n\n")
	s += w("One caller decides once with each of these in turn, the order rotating every round, %d rounds per limit, each on one key of its own. ", rep.Mode.Paired)
	s += w("The machine's noise (the disk's flush time above all) falls on all of them alike, so these ratios are steadier than those of the table above, whose contenders take turns only slice by slice. ")
	s += w("The p50 here is that of the exact sample, not a histogram bucket's as above, so the two tables differ a little even for the same contender.\n\n")
	s += "| contender | allow-heavy | × floor | deny-heavy | × floor |\n|---|--:|--:|--:|--:|\n"
	find := func(id string, lim Limit) *Paired {
		for _, p := range rep.Paired {
			if p.Def.ID == id && p.Limit == lim {
				return p
			}
		}
		return nil
	}
	for _, id := range pairedIDs {
		def := findDef(rep.Defs, id)
		if def == nil {
			continue
		}
		s += "| " + def.Name
		for _, lim := range []Limit{limitAllow, limitDeny} {
			p, floor := find(id, lim), find("floor", lim)
			switch {
			case p == nil || p.N == 0:
				s += " | — | —"
			case floor == nil || floor.N == 0:
				s += w(" | %s | —", fmtDur(p.P50))
			default:
				s += w(" | %s | %.2f×", fmtDur(p.P50), float64(p.P50)/float64(floor.P50))
			}
		}
		s += " |\n"
	}
	if b, p := find("txlimit-batched", limitAllow), find("txlimit", limitAllow); b != nil && p != nil && b.N > 0 && p.N > 0 {
		s += w("\ntxlimit batched (pool) / txlimit (pool): **%.2f×** (allow-heavy)", float64(b.P50)/float64(p.P50))
		if bd, pd := find("txlimit-batched", limitDeny), find("txlimit", limitDeny); bd != nil && pd != nil && bd.N > 0 && pd.N > 0 {
			s += w(", **%.2f×** (deny-heavy)", float64(bd.P50)/float64(pd.P50))
		}
		s += ".\n"
	}
	for _, p := range rep.Paired {
		if p.Errors > 0 {
			s += w("\n%s, %s: %d of %d decisions failed and are left out (last: %v).\n", p.Def.Name, p.Limit.Name, p.Errors, p.Errors+p.N, p.Err)
		}
	}
	return s
}
