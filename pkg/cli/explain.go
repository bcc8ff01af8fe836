package cli

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"text/tabwriter"
)

func runExplain(_ context.Context, args []string, stdout, stderr io.Writer) error {
	var pf policyFlags
	fs := newFlagSet("explain", "ip-masq-agent explain [flags] ADDR...", stderr)
	pf.register(fs)
	pos, err := parseInterspersed(fs, args)
	if err != nil {
		return err
	}
	if len(pos) == 0 {
		return usageError{fmt.Errorf("explain needs at least one address")}
	}
	addrs := make([]netip.Addr, len(pos))
	for i, s := range pos {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return usageError{fmt.Errorf("%q is not an IP address", s)}
		}
		addrs[i] = a
	}
	p, err := pf.load()
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ADDRESS\tVERDICT\tRULE\tCIDR\tFROM")
	for _, a := range addrs {
		v := p.Decide(a)
		if v.Rule == nil {
			fmt.Fprintf(tw, "%s\t%s\t-\t-\t%s\n", a, v.Action, v.Reason)
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%s #%d\t%s\t%s\n", a, v.Action, v.Rule.Family, v.Number, v.Rule.Prefix, v.Rule.Source())
	}
	return tw.Flush()
}
