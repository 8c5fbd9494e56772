package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

type memoryLimiter struct {
	limits []Limit
	keys   sync.Map // limit name + "\x00" + key -> *rate.Limiter
}

func (c *memoryLimiter) Decide(_ context.Context, limit, key string) (Decision, error) {
	k := limit + "\x00" + key
	v, ok := c.keys.Load(k)
	if !ok {
		var l *Limit
		for i := range c.limits {
			if c.limits[i].Name == limit {
				l = &c.limits[i]
			}
		}
		if l == nil {
			return Decision{}, fmt.Errorf("memory: unknown limit %q", limit)
		}
		v, _ = c.keys.LoadOrStore(k, rate.NewLimiter(rate.Limit(l.PerSecond()), int(l.Burst)))
	}
	now := time.Now()
	return Decision{Allowed: v.(*rate.Limiter).AllowN(now, 1), At: now}, nil
}

func (c *memoryLimiter) Close() {}
