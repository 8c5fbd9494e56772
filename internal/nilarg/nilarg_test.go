package nilarg

import "testing"

func TestReason(t *testing.T) {
	var p *int
	var s stringer
	one := 1
	for _, c := range []struct {
		v    any
		want string
	}{
		{nil, "is nil"},
		{p, "is a nil *int"},
		{s, "is nil"},
		{&one, ""},
		{one, ""},
	} {
		if got := Reason(c.v); got != c.want {
			t.Errorf("Reason(%#v) = %q, want %q", c.v, got, c.want)
		}
	}
}

// stringer is an interface type, to pass a nil interface value converted to any.
type stringer interface{ String() string }
