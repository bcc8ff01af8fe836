package cli

import (
	"context"
	"fmt"
	"io"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
)

// runCleanup removes everything the agent installs, for both address families and whatever
// backend or flags it ran with. It takes the agent's flags, so that the DaemonSet's arguments can
// be reused as they are; only --masq-chain (and --v) matter.
func runCleanup(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var af agentFlags
	fs := newFlagSet("cleanup", "ip-masq-agent cleanup [flags]", stderr)
	af.register(fs)
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usageError{fmt.Errorf("cleanup takes no arguments, got %q", pos)}
	}
	if err := iptables.ValidateChain(af.masqChain); err != nil {
		return usageError{err}
	}
	log := newLogger(stderr, af.verbosity)
	b, err := iptables.New(ctx, iptables.Options{Chain: af.masqChain, Logger: log})
	if err != nil {
		return err
	}
	if err := b.Cleanup(ctx); err != nil {
		return fmt.Errorf("cleanup incomplete: %w", err)
	}
	_, err = fmt.Fprintf(stdout, "chain %s and its jumps are gone (IPv4 and IPv6, iptables-nft and iptables-legacy)\n", af.masqChain)
	return err
}
