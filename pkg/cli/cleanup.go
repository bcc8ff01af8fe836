package cli

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/backends"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
)

// runCleanup removes everything the agent installs, for both address families and whatever
// backend or flags it ran with: every backend's state (the iptables chain and jumps in both
// modes, the BPF programs on every device with the pins under --bpffs). It takes the agent's
// flags, so that the DaemonSet's arguments can be reused as they are; only --masq-chain, --bpffs
// (and --v) matter.
func runCleanup(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var af agentFlags
	fs := newFlagSet("cleanup", "ip-masq-agent cleanup [flags]", stderr)
	af.register(fs)
	if err := parseNoArgs(fs, args); err != nil {
		return err
	}
	if err := iptables.ValidateChain(af.masqChain); err != nil {
		return usageError{err}
	}
	log := newLogger(stderr, af.verbosity)
	var errs []error
	for _, r := range backends.Cleanup(ctx, af.backendOptions(log)) {
		if r.Err != nil {
			errs = append(errs, r.Err)
			continue
		}
		fmt.Fprintf(stdout, "%s: %s\n", r.Backend, r.Removed)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("cleanup incomplete: %w", err)
	}
	return nil
}
