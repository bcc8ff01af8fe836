package cli

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"text/tabwriter"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

func runExplain(_ context.Context, args []string, stdout, stderr io.Writer) error {
	var pf policyFlags
	var bf backendFlags
	fs := newFlagSet(commandNamed("explain"), stderr)
	pf.register(fs)
	bf.register(fs)
	pos, err := parseInterspersed(fs.FlagSet, args)
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
	if err := bf.check(); err != nil {
		return err
	}
	p, err := pf.load()
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ADDRESS\tVERDICT\tSOURCE\tRULE\tCIDR\tFROM")
	for _, a := range addrs {
		v := p.Decide(a)
		if v.Rule == nil {
			fmt.Fprintf(tw, "%s\t%s\t%s\t-\t-\t%s\n", a, v.Action, leavesFrom(v), v.Reason)
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s #%d\t%s\t%s\n", a, v.Action, leavesFrom(v), v.Rule.Family, v.Number, v.Rule.Prefix, v.Rule.Source())
	}
	return tw.Flush()
}

// leavesFrom is the source address traffic of a verdict leaves with: the pod's own ("pod"), the
// uplink's primary address ("uplink"), or a configured masquerade address.
func leavesFrom(v policy.Verdict) string {
	switch {
	case v.Action == policy.Return:
		return "pod"
	case v.Rule.Address.IsValid():
		return v.Rule.Address.String()
	}
	return "uplink"
}
