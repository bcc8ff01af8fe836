package backends

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// iptablesBackend is the iptables datapath: the chain (--masq-chain) in the nat table of the
// node's iptables mode, hooked from POSTROUTING.
var iptablesBackend = Backend{
	Name:  iptables.Name,
	Title: "iptables",
	New: func(ctx context.Context, o Options) (datapath.Backend, error) {
		if len(o.Interfaces) > 0 {
			// MASQUERADE takes the address of whichever device a packet leaves by.
			o.logger().Info("the iptables backend masquerades on every uplink; --interfaces is ignored", "component", "backends")
		}
		return iptables.New(ctx, iptables.Options{Chain: o.Chain, Runner: o.Runner, Logger: o.Logger})
	},
	Cleanup: func(ctx context.Context, o Options) (string, error) {
		// A fixed mode skips detection: Cleanup covers both modes anyway. Without the tools of
		// either mode, nothing can have installed a chain through them.
		var missing []string
		for _, mode := range []iptables.Mode{iptables.ModeNFT, iptables.ModeLegacy} {
			b, err := iptables.New(ctx, iptables.Options{Chain: o.Chain, Mode: mode, Runner: o.Runner, Logger: o.Logger})
			var mt *iptables.MissingToolsError
			if errors.As(err, &mt) {
				missing = append(missing, err.Error())
				continue
			}
			if err != nil {
				return "", err
			}
			if err := b.Cleanup(ctx); err != nil {
				return "", err
			}
			return fmt.Sprintf("chain %s and its jumps are gone (IPv4 and IPv6, iptables-nft and iptables-legacy)", b.Chain()), nil
		}
		return fmt.Sprintf("no tools, so no chain to remove (%s)", strings.Join(missing, "; ")), nil
	},
	Read: func(ctx context.Context, o Options, p *policy.Policy) ([]datapath.Reader, error) {
		runner := o.Runner
		if runner == nil {
			runner = iptables.ExecRunner{}
		}
		installed, err := iptables.Inspect(ctx, runner, o.chain(), p)
		if err != nil {
			err = fmt.Errorf("read iptables: %w", err)
		}
		var out []datapath.Reader
		for _, in := range installed {
			out = append(out, in)
		}
		return out, err
	},
	Absent: func(o Options) string {
		return fmt.Sprintf("no %s chain in iptables-nft or iptables-legacy", o.chain())
	},
	CountNote: "iptables counts connections: the first packet of each",
	Render:    func(p *policy.Policy, o Options) string { return iptables.RenderAll(p, o.chain()) },
}

// chain is --masq-chain, or the default chain when unset.
func (o Options) chain() string {
	if o.Chain == "" {
		return iptables.DefaultChain
	}
	return o.Chain
}
