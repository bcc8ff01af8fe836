package cli

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/backends"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nodelock"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/version"
)

// runCleanup removes everything the agent installs, for both address families and whatever
// backend or flags it ran with: every backend's state (backends.Installs). It takes the agent's
// flags, so that the DaemonSet's arguments can be reused as they are; the backends' own flags
// (with --interfaces), --force and --v are those it reads.
//
// It holds the node lock while it works, so no agent starts meanwhile, and refuses to run while
// an agent holds it: removing a running agent's datapath would only last until its drift check
// put it back, or, worse, leave it half removed. --force runs it anyway.
func runCleanup(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var force bool
	af, err := parseAgentFlags("cleanup", args, stderr, append(datapathFlagNames(), "v"), func(fs *flagSet) {
		fs.BoolVar(&force, "force", false, "remove everything even while an agent runs on the node (it holds the node lock)")
	})
	if err != nil {
		return err
	}
	log := newLogger(stderr, af.verbosity)
	lock, err := nodelock.TryAcquire(nodelock.Name, nodelock.Me("cleanup", version.Version))
	if held, ok := errors.AsType[*nodelock.HeldError](err); ok && !force {
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
