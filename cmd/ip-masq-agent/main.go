// Command ip-masq-agent decides, per destination, whether pod traffic leaving the node keeps the
// pod's source address or is masqueraded behind the node's address.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := cli.Run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "ip-masq-agent:", err)
		os.Exit(cli.ExitCode(err))
	}
}
