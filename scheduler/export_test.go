package scheduler

import "time"

// SetGateNow replaces the clock a Gate uses to tell whether a paid-for job is due yet.
func SetGateNow(g *Gate, now func() time.Time) { g.now = now }

// SetStrandedNow makes a StrandedWorker check at the times now returns instead of the database's
// clock.
func SetStrandedNow(w *StrandedWorker, now func() time.Time) { w.now = now }

// MaxSnooze is the longest single snooze a Gate asks for.
const MaxSnooze = maxSnooze
