package main

import "context"

func init() {
	register(&Def{
		Order:  7,
		ID:     "txlimit-16-ser",
		Name:   "txlimit 16 shards in SERIALIZABLE tx",
		What:   "As txlimit in SERIALIZABLE tx with Config.Shards = 16.",
		Family: FamilyTxlimit,
		Shards: 16,
		New: func(_ context.Context, env *Env) (Contender, error) {
			lim, err := newTxlimit(env, 16)
			if err != nil {
				return nil, err
			}
			return &txlimitSerializable{env: env, lim: lim}, nil
		},
	})
}
