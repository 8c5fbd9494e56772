package ratelimit

// SetShardPicker replaces how l picks the two candidate shards of a sharded limit (n >= 2), so
// tests can choose them. It must return two distinct shards in [0, n).
func SetShardPicker(l *Limiter, pick func(n int) (a, b int)) { l.pick = pick }
