package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/backends"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// defaultTop is how many of the busiest remote endpoints dump shows.
const defaultTop = 10

// runDump prints the installed datapath: its rules with their hit counters and, for a datapath
// with a NAT table of its own, a summary of that table. It reads them from the kernel, so
// it works while the agent runs and after it stopped. It takes the agent's flags, so that the
// DaemonSet's arguments can be reused, and reads some: the configuration the running agent
// applied, or where none answers the configuration and policy flags, say which rule each
// installed one is (its origin); the backends' own flags, and --interfaces, where to look.
func runDump(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var top int
	var fromFile bool
	af, err := parseAgentFlags("dump", args, stderr, append(policyFlagNames(), datapathFlagNames()...), func(fs *flagSet) {
		fs.IntVar(&top, "top", defaultTop, "how many of the busiest remote endpoints of the NAT table to show")
		registerFromFile(fs, &fromFile)
	})
	if err != nil {
		return err
	}
	if _, _, err := af.options(); err != nil {
		return err
	}
	return dump(ctx, af, top, fromFile, stdout, stderr)
}

// dump prints what is installed, and on stderr which configuration (livePolicy) names its rules.
func dump(ctx context.Context, af *agentFlags, top int, fromFile bool, stdout, stderr io.Writer) error {
	p, which, err := af.livePolicy(ctx, fromFile)
	if err != nil {
		// No agent answered and the file is bad (the agent keeps the last good configuration,
		// which dump cannot know then), or the agent's answer is: the counters are still worth
		// seeing.
		fmt.Fprintf(stderr, "warning: %v\nwarning: rules are shown without their origin\n", err)
		p = nil
	}
	readers, absent, findErr := backends.Installed(ctx, af.backendOptions(nil), p)
	if len(readers) == 0 {
		if findErr != nil {
			return findErr
		}
		return fmt.Errorf("no datapath installed: %s", strings.Join(absent, ", "))
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
	if p != nil && len(p.Sources) > 0 {
		fmt.Fprintln(stdout)
		errs = append(errs, writeSourceRules(stdout, p))
	}
	fmt.Fprintln(stderr, which)
	return errors.Join(append(errs, findErr)...)
}

// writeSourceRules prints the source rules in their order of precedence, each with its sources:
// its CIDRs and the pods of this node its selectors chose, which the datapath holds.
func writeSourceRules(w io.Writer, p *policy.Policy) error {
	fmt.Fprintln(w, "source rules (the first that holds a source decides its traffic)")
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "#\tNAME\tCIDRS\tSELECTORS\tPODS")
	for _, s := range p.Sources {
		cidrs, sel, pods := "-", "-", "-"
		if len(s.CIDRs) > 0 {
			cidrs = joinStrings(s.CIDRs)
		}
		if s.Selects {
			sel = selectorWhy(&s)
			pods = fmt.Sprint(len(s.Pods))
			if len(s.Pods) > 0 && len(s.Pods) <= maxPodsShown {
				pods += " (" + joinAddrs(s.Pods) + ")"
			}
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\n", s.Index, s.Name, cidrs, sel, pods)
	}
	return tw.Flush()
}

// maxPodsShown bounds the pod addresses dump lists per source rule (it counts them all).
const maxPodsShown = 8

func joinStrings[S fmt.Stringer](ss []S) string {
	out := make([]string, len(ss))
	for i, s := range ss {
		out[i] = s.String()
	}
	return strings.Join(out, ", ")
}

// writeReader prints one datapath: a title, its rules as `iptables -L -v` shows them (with the
// rule each one is), and the NAT table when it has one.
func writeReader(ctx context.Context, w io.Writer, r datapath.Reader, top int) error {
	info := r.Info()
	fmt.Fprintln(w, title(info))
	writeMissing(w, info)
	counters, err := r.Counters(ctx)
	if err != nil {
		return fmt.Errorf("read %s counters: %w", info.Backend, err)
	}
	if err := writeCounters(w, counters); err != nil {
		return err
	}
	if b, ok := backends.Lookup(info.Backend); ok && b.Counts != "" {
		fmt.Fprintf(w, "%s counts %s\n", b.Name, b.Counts)
	}
	if nat, ok := r.(datapath.NATReporter); ok {
		sum, err := nat.NATSummary(ctx, top)
		if err != nil {
			return fmt.Errorf("read %s NAT table: %w", info.Backend, err)
		}
		if err := writeNAT(w, sum); err != nil {
			return err
		}
	}
	if ur, ok := r.(datapath.UplinkReporter); ok {
		ups, err := ur.Uplinks(ctx)
		if err != nil {
			return fmt.Errorf("read %s uplinks: %w", info.Backend, err)
		}
		if err := writeUplinks(w, ups); err != nil {
			return err
		}
	}
	if hr, ok := r.(datapath.HookReporter); ok {
		hooks, err := hr.Hooks(ctx)
		if err != nil {
			return fmt.Errorf("read %s hooks: %w", info.Backend, err)
		}
		return writeHooks(w, hooks)
	}
	return nil
}

// writeUplinks prints the devices pod traffic can leave by, what makes each one an uplink, and
// whether the programs run there.
func writeUplinks(w io.Writer, ups []datapath.Uplink) error {
	fmt.Fprintln(w, "\nuplinks")
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "DEVICE\tIFINDEX\tVIA\tCOVERED")
	for _, u := range ups {
		covered := "yes"
		switch {
		case !u.Covered:
			covered = "NO: " + u.Note
		case u.Note != "":
			covered = "yes: " + u.Note
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\n", u.Device, u.Ifindex, u.Via, covered)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(ups) == 0 {
		fmt.Fprintln(w, "(no uplinks)")
	}
	return nil
}

// writeMissing lists the kernel features the datapath does without, and what it does instead.
func writeMissing(w io.Writer, info datapath.Info) {
	for _, m := range info.Missing {
		fmt.Fprintf(w, "this kernel lacks %s\n", m)
	}
}

// title names a datapath: its backend, how it is attached, and its details.
func title(info datapath.Info) string {
	s := info.Backend
	if info.AttachMode != datapath.AttachNone && info.AttachMode != "" {
		s += " (" + info.AttachMode + ")"
	}
	if info.Details != "" {
		s += ": " + info.Details
	}
	return s
}

// writeCounters prints the rules as `iptables -L -v` shows them, with the rule each one is, and
// the address a rule masquerades to (to:ADDR, as iptables -L shows SNAT's) where the datapath
// tells it.
func writeCounters(w io.Writer, counters []datapath.RuleCounter) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "FAMILY\tRULE\tACTION\tCIDR\tORIGIN\tPACKETS\tBYTES")
	unknown := 0
	for _, c := range counters {
		rule := fmt.Sprint(c.Rule)
		if c.Rule == 0 {
			rule = "-"
			unknown++
		}
		to := ""
		if c.Address.IsValid() {
			to = "\tto:" + c.Address.String()
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%d%s\n", c.Family, rule, c.Action, c.Prefix, c.Source(), c.Packets, c.Bytes, to)
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
	return nil
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

// writeHooks prints each uplink's hooks: the programs of others there, ahead of ours and behind
// it, and whether ours is bypassed.
func writeHooks(w io.Writer, hooks []datapath.Hook) error {
	fmt.Fprintln(w, "\nhooks")
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "DEVICE\tDIRECTION\tPOLICY\tAHEAD OF OURS\tBEHIND OURS")
	list := func(ns []string) string {
		if len(ns) == 0 {
			return "-"
		}
		return strings.Join(ns, "; ")
	}
	bypassed := false
	for _, h := range hooks {
		state := "enforced"
		if h.Bypassed {
			state, bypassed = "BYPASSED", true
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", h.Device, h.Direction, state, list(h.Ahead), list(h.Behind))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(hooks) == 0 {
		fmt.Fprintln(w, "(no uplinks)")
	}
	if bypassed {
		fmt.Fprintln(w, "BYPASSED: a program ahead of ours ends the chain; ours saw none of the device's packets")
	}
	return nil
}
