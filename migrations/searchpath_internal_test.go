package migrations

import (
	"slices"
	"testing"
)

func TestSplitSearchPath(t *testing.T) {
	for i, c := range []struct {
		in   string
		want []string
	}{
		{`"$user", public`, []string{"$user", "public"}},
		{`App,Other`, []string{"app", "other"}},
		{` "Mixed Case" , "with""quote",x`, []string{"Mixed Case", `with"quote`, "x"}},
		{``, nil},
		{`""`, []string{""}},
		{`ÄPP, Zé`, []string{"Äpp", "zé"}}, // Postgres folds A to Z only in a multibyte encoding
	} {
		if got := splitSearchPath(c.in); !slices.Equal(got, c.want) {
			t.Errorf("step %d: splitSearchPath(%q) = %q; want %q", i, c.in, got, c.want)
		}
	}
}
