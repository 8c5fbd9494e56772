package countbound

import (
	"math"
	"testing"
)

func TestCheck(t *testing.T) {
	for _, c := range []struct {
		per, allow float64
		sharded    bool
		count      float64
		most       float64
		ok         bool
	}{
		{per: 10, count: 10, most: 10, ok: true},
		{per: 10, count: 10.5, most: 10},
		{per: 5, sharded: true, count: 10, most: 10, ok: true}, // two shards charged together
		{per: 5, sharded: true, count: 10.5, most: 10},         // more than two shards hold
		{per: 1, allow: 2, count: 3, most: 3, ok: true},        // down to -2
		{per: 1, allow: 2, sharded: true, count: 6, most: 6, ok: true},
		{per: 0.1, allow: 0.2, count: 0.30000000000000004, most: 0.30000000000000004}, // 0.1 + 0.2 in float64: admitted by the bound's rounding only
		{per: 1, allow: math.Inf(1), count: 1e15, most: math.Inf(1), ok: true},
	} {
		most, ok := Check(c.per, c.allow, c.sharded, c.count)
		if most != c.most || ok != c.ok {
			t.Errorf("Check(%g, %g, %v, %g) = %g, %v; want %g, %v", c.per, c.allow, c.sharded, c.count, most, ok, c.most, c.ok)
		}
	}
}
