package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpfbackend"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
)

// runCleanup removes everything the agent installs, for both address families and whatever
// backend or flags it ran with: the iptables chain and jumps in both modes, and the BPF programs
// on every device with the pins under --bpffs. It takes the agent's flags, so that the
// DaemonSet's arguments can be reused as they are; only --masq-chain, --bpffs (and --v) matter.
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
	var errs []error
	b, err := iptables.New(ctx, iptables.Options{Chain: af.masqChain, Logger: log})
	var missing *iptables.MissingToolsError
	switch {
	case errors.As(err, &missing):
		fmt.Fprintf(stdout, "iptables: no tools, so no chain to remove (%v)\n", err)
	case err != nil:
		errs = append(errs, err)
	default:
		if err := b.Cleanup(ctx); err != nil {
			errs = append(errs, err)
		} else {
			fmt.Fprintf(stdout, "iptables: chain %s and its jumps are gone (IPv4 and IPv6, iptables-nft and iptables-legacy)\n", af.masqChain)
		}
	}
	removed, err := bpfbackend.Cleanup(ctx, af.bpffs, log)
	if err != nil {
		errs = append(errs, err)
	} else {
		fmt.Fprintf(stdout, "bpf: %d program attachments removed (tcx links and tc filters on every device)", len(removed.Attachments))
		if removed.BPFDenied != nil {
			fmt.Fprintf(stdout, ", %d tcx link pins removed, which detaches each link that no process holds open, unchecked: %v;",
				removed.UnpinnedLinks, removed.BPFDenied)
		}
		if removed.PinDir != "" {
			fmt.Fprintf(stdout, ", pins under %s removed", removed.PinDir)
		} else {
			fmt.Fprintf(stdout, ", nothing pinned under %s", filepath.Join(af.bpffs, bpfbackend.PinDir))
		}
		fmt.Fprintln(stdout)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("cleanup incomplete: %w", err)
	}
	return nil
}
