package cli

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/backends"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nodelock"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/version"
)

// runCleanup removes everything the agent installs, for both address families and whatever
// backend or flags it ran with: every backend's state (the iptables chain and jumps in both
// modes, the BPF programs on every device with the pins under --bpffs). It takes the agent's
// flags, so that the DaemonSet's arguments can be reused as they are; only --masq-chain, --bpffs,
// --force (and --v) matter.
//
// It holds the node lock while it works, so no agent starts meanwhile, and refuses to run while
// an agent holds it: removing a running agent's datapath would only last until its drift check
// put it back, or, worse, leave it half removed. --force runs it anyway.
func runCleanup(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var af agentFlags
	fs := newFlagSet("cleanup", "ip-masq-agent cleanup [flags]", stderr)
	af.register(fs)
	force := fs.Bool("force", false, "remove everything even while an agent runs on the node (it holds the node lock)")
	if err := parseNoArgs(fs, args); err != nil {
		return err
	}
	if err := iptables.ValidateChain(af.masqChain); err != nil {
		return usageError{err}
	}
	log := newLogger(stderr, af.verbosity)
	lock, err := nodelock.TryAcquire(nodelock.Name, nodelock.Me("cleanup", version.Version))
	if held, ok := errors.AsType[*nodelock.HeldError](err); ok && !*force {
		return fmt.Errorf("cleanup refused: %w; stop the agent first, or pass --force", held)
	} else if ok {
		log.Warn("cleaning up under a running agent (--force): it may install its datapath again", "component", "cli", "holder", held.Holder.String())
	} else if err != nil {
		return err
	} else {
		defer lock.Release()
	}
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
