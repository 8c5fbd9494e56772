// Command txlimit is txlimit's operator command: migrate a database, list the limit names in it,
// inspect, reset and prune its limits. Run it with go run ./cmd/txlimit or install it with
// go install github.com/txlimit/txlimit/cmd/txlimit@latest; `txlimit -h` lists the flags, and
// package cli documents the commands, the --config file and the exit codes.
package main

import (
	"context"
	"os"
	"os/signal"

	"github.com/txlimit/txlimit/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	code := cli.Run(ctx, os.Args[1:], os.Stdout, os.Stderr, nil)
	stop()
	os.Exit(code)
}
