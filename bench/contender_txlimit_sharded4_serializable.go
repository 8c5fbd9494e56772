package main

import "context"

func init() {
	register(&Def{
		Order:     8,
		ID:        "txlimit-4-ser",
		Name:      "txlimit 4 shards in SERIALIZABLE tx",
		What:      "As txlimit in SERIALIZABLE tx with Config.Shards = 4; run only in the shard comparison.",
		Family:    FamilyTxlimit,
		Shards:    4,
		SweepOnly: true,
		New: func(_ context.Context, env *Env) (Contender, error) {
			lim, err := newTxlimit(env, 4)
			if err != nil {
				return nil, err
			}
			return &txlimitSerializable{env: env, lim: lim}, nil
		},
	})
}
