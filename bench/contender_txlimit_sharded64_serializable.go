package main

import "context"

func init() {
	register(&Def{
		Order:     9,
		ID:        "txlimit-64-ser",
		Name:      "txlimit 64 shards in SERIALIZABLE tx",
		What:      "As txlimit in SERIALIZABLE tx with Config.Shards = 64; run only in the shard comparison.",
		Family:    FamilyTxlimit,
		Shards:    64,
		SweepOnly: true,
		New: func(_ context.Context, env *Env) (Contender, error) {
			lim, err := newTxlimit(env, 64)
			if err != nil {
				return nil, err
			}
			return &txlimitSerializable{env: env, lim: lim}, nil
		},
	})
}
