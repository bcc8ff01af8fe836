package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"text/tabwriter"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpfbackend"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// BPFPinDir is the directory under --bpffs where the BPF backend pins its maps and links.
const BPFPinDir = bpfbackend.PinDir

// defaultTop is how many of the busiest remote endpoints dump shows.
const defaultTop = 10

// runDump prints the installed datapath: its rules with their hit counters and, for a datapath
// with a NAT table of its own, a summary of that table. It reads the kernel, not the agent, so
// it works while the agent runs and after it stopped. It takes the agent's flags, so that the
// DaemonSet's arguments can be reused: the configuration and policy flags say which rule each
// installed one is (its origin), --masq-chain and --bpffs where to look.
func runDump(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var af agentFlags
	fs := newFlagSet("dump", "ip-masq-agent dump [flags]", stderr)
	af.register(fs)
	top := fs.Int("top", defaultTop, "how many of the busiest remote endpoints of the NAT table to show")
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usageError{fmt.Errorf("dump takes no arguments, got %q", pos)}
	}
	if _, _, err := af.options(); err != nil {
		return err
	}
	return dump(ctx, &af, *top, iptables.ExecRunner{}, stdout, stderr)
}

func dump(ctx context.Context, af *agentFlags, top int, runner iptables.Runner, stdout, stderr io.Writer) error {
	p, err := af.load()
	if err != nil {
		// The agent keeps the last good configuration; dump cannot know it, but the counters
		// are still worth seeing.
		fmt.Fprintf(stderr, "warning: %v\nwarning: rules are shown without their origin\n", err)
		p = nil
	}
	readers, findErr := findInstalled(ctx, af, p, runner)
	if len(readers) == 0 {
		if findErr != nil {
			return findErr
		}
		return fmt.Errorf("no datapath installed: no %s chain in iptables-nft or iptables-legacy, nothing pinned under %s",
			af.masqChain, filepath.Join(af.bpffs, BPFPinDir))
	}
	var errs []error
	for i, r := range readers {
		if i > 0 {
			fmt.Fprintln(stdout)
		}
		if err := writeReader(ctx, stdout, r, top); err != nil {
			errs = append(errs, err)
		}
		if c, ok := r.(io.Closer); ok {
			errs = append(errs, c.Close())
		}
	}
	return errors.Join(append(errs, findErr)...)
}

// findInstalled returns a Reader of every datapath installed on the node: the BPF datapath,
// then the chain in each iptables mode that holds it. What one of them fails to find is
// returned as an error next to the others.
func findInstalled(ctx context.Context, af *agentFlags, p *policy.Policy, runner iptables.Runner) ([]datapath.Reader, error) {
	var out []datapath.Reader
	var errs []error
	if r, err := openBPF(ctx, af.bpffs, p); err != nil {
		errs = append(errs, err)
	} else if r != nil {
		out = append(out, r)
	}
	installed, err := iptables.Inspect(ctx, runner, af.masqChain, p)
	if err != nil {
		errs = append(errs, fmt.Errorf("read iptables: %w", err))
	}
	for _, in := range installed {
		out = append(out, in)
	}
	return out, errors.Join(errs...)
}

// openBPF returns a Reader of what the BPF backend pinned under <bpffs>/ip-masq-agent/, or nil
// when nothing is pinned there. It opens the pinned maps read-only (loading no program, creating
// no map) and maps the counter slots to the rules of p (nil when the configuration could not be
// read).
func openBPF(_ context.Context, bpffs string, p *policy.Policy) (datapath.Reader, error) {
	r, err := bpfbackend.OpenReader(bpffs, p)
	if err != nil {
		return nil, err
	}
	if r == nil {
		return nil, nil // not a nil *Reader inside the interface
	}
	return r, nil
}

// writeReader prints one datapath: a title, its rules as `iptables -L -v` shows them (with the
// rule each one is), and the NAT table when it has one.
func writeReader(ctx context.Context, w io.Writer, r datapath.Reader, top int) error {
	info := r.Info()
	title := info.Backend
	if info.AttachMode != datapath.AttachNone && info.AttachMode != "" {
		title += " (" + info.AttachMode + ")"
	}
	if info.Details != "" {
		title += ": " + info.Details
	}
	fmt.Fprintln(w, title)
	counters, err := r.Counters(ctx)
	if err != nil {
		return fmt.Errorf("read %s counters: %w", info.Backend, err)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "FAMILY\tRULE\tACTION\tCIDR\tORIGIN\tPACKETS\tBYTES")
	unknown := 0
	for _, c := range counters {
		rule := fmt.Sprint(c.Rule)
		if c.Rule == 0 {
			rule = "-"
			unknown++
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%d\n", c.Family, rule, c.Action, c.Prefix, c.Source(), c.Packets, c.Bytes)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(counters) == 0 {
		fmt.Fprintln(w, "(no rules)")
	}
	if unknown > 0 {
		fmt.Fprintln(w, "rule -: installed, but not a rule of the configuration given to dump (give dump the agent's --config and policy flags)")
	}
	if info.Backend == iptables.Name {
		fmt.Fprintln(w, "iptables counts connections: the first packet of each")
	}
	nat, ok := r.(datapath.NATReporter)
	if !ok {
		return nil
	}
	sum, err := nat.NATSummary(ctx, top)
	if err != nil {
		return fmt.Errorf("read %s NAT table: %w", info.Backend, err)
	}
	return writeNAT(w, sum)
}

func writeNAT(w io.Writer, sum datapath.NATSummary) error {
	fmt.Fprintln(w, "\nNAT table")
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "FAMILY\tPROTOCOL\tSTATE\tENTRIES")
	var total uint64
	for _, e := range sum.Entries {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\n", e.Family, e.Protocol, e.State, e.Entries)
		total += e.Entries
	}
	fmt.Fprintf(tw, "total\t\t\t%d\n", total)
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(sum.Busiest) == 0 {
		return nil
	}
	fmt.Fprintln(w, "\nbusiest remote endpoints")
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PROTOCOL\tENDPOINT\tENTRIES")
	for _, e := range sum.Busiest {
		fmt.Fprintf(tw, "%s\t%s\t%d\n", e.Protocol, e.Endpoint, e.Entries)
	}
	return tw.Flush()
}
