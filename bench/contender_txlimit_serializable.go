package main

import "context"

func init() {
	register(&Def{
		Order:  2,
		ID:     "txlimit-ser",
		Name:   "txlimit in SERIALIZABLE tx",
		What:   "Limiter.Limit inside its own SERIALIZABLE transaction, run and retried by ratelimit.InSerializableTx (defaults: 10 attempts, 2-200 ms jittered backoff).",
		Family: FamilyTxlimit,
		New: func(_ context.Context, env *Env) (Contender, error) {
			lim, err := newTxlimit(env, 1)
			if err != nil {
				return nil, err
			}
			return &txlimitSerializable{env: env, lim: lim}, nil
		},
	})
}
