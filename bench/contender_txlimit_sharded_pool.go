package main

import "context"

func init() {
	register(&Def{
		Order:  6,
		ID:     "txlimit-16",
		Name:   "txlimit 16 shards (pool)",
		What:   "As txlimit (pool) with Config.Shards = 16: the same total limit split over 16 rows.",
		Family: FamilyTxlimit,
		Shards: 16,
		New: func(_ context.Context, env *Env) (Contender, error) {
			lim, err := newTxlimit(env, 16)
			if err != nil {
				return nil, err
			}
			return &txlimitPool{env: env, lim: lim}, nil
		},
	})
}
