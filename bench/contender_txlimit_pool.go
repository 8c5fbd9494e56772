package main

import "context"

func init() {
	register(&Def{
		Order:  1,
		ID:     "txlimit",
		Name:   "txlimit (pool)",
		What:   "Limiter.Limit on the pool: one statement in its own implicit transaction (the default path).",
		Family: FamilyTxlimit,
		New: func(_ context.Context, env *Env) (Contender, error) {
			lim, err := newTxlimit(env, 1)
			if err != nil {
				return nil, err
			}
			return &txlimitPool{env: env, lim: lim}, nil
		},
	})
}
