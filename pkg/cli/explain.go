package cli

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"text/tabwriter"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/backends"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

func runExplain(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var pf policyFlags
	var bf backendFlags
	var fromFile bool
	var from, kubeconfig string
	fs := newFlagSet(commandNamed("explain"), stderr)
	fs.group("explain", func() {
		registerFromFile(fs, &fromFile)
		fs.StringVar(&from, "from", "", "the source: a pod address, or NAMESPACE/POD (read from the API server); its source rule, if one holds it, decides")
		fs.StringVar(&kubeconfig, "kubeconfig", "", "kubeconfig file of the API server, for --from NAMESPACE/POD; empty means the pod's service account")
	})
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
	p, which, err := pf.livePolicy(ctx, fromFile)
	if err != nil {
		return err
	}
	var src *explainSource
	if from != "" {
		if src, err = resolveSource(ctx, from, kubeconfig, p); err != nil {
			return err
		}
		fmt.Fprintln(stdout, src.describe())
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ADDRESS\tVERDICT\tSOURCE\tRULE\tCIDR\tFROM")
	for _, a := range addrs {
		v := src.decide(p, a)
		if v.Rule == nil {
			fmt.Fprintf(tw, "%s\t%s\t%s\t-\t-\t%s\n", a, v.Action, leavesFrom(v), v.Reason)
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s #%d\t%s\t%s\n", a, v.Action, leavesFrom(v), v.Rule.Family, v.Number, v.Rule.Prefix, v.Rule.Source())
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(stderr, which)
	if n := len(p.Sources); n > 0 && src == nil {
		fmt.Fprintf(stderr, "note: %d source rules decide the traffic of their own sources; these verdicts are for a source none holds (--from SRC explains a source's)\n", n)
	}
	installedOn(ctx, stdout, bf, p)
	return nil
}

// installedOn names the datapath installed on this node, how it is attached and what the
// kernel lacks, where there is one that this process can read: the datapath that carries out
// the verdicts. Nothing where there is none (or it cannot be read, without privileges).
func installedOn(ctx context.Context, w io.Writer, bf backendFlags, p *policy.Policy) {
	readers, _, _ := backends.Installed(ctx, backends.Options{Settings: bf.own}, p)
	for _, r := range readers {
		fmt.Fprintf(w, "\ninstalled on this node: %s\n", title(r.Info()))
		writeMissing(w, r.Info())
		if c, ok := r.(io.Closer); ok {
			c.Close()
		}
	}
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
