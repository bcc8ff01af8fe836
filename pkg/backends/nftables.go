package backends

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nftables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// nftablesBackend is the nftables datapath: a table of its own per family, hooked at nat
// postrouting.
var nftablesBackend = Backend{
	Name:     nftables.Name,
	Title:    "nftables",
	AutoWhen: "when the node's kube-proxy runs in nftables mode or the node has no iptables",
	// Where the node has iptables (iptables-nft included, whose chains are nftables already),
	// the iptables backend's chain sits beside kube-proxy's, hooked as upstream hooks it; where
	// kube-proxy writes nftables, or the distribution ships no iptables, nftables fits.
	Fits: func(ctx context.Context, o Options) error {
		tables, err := nftables.KubeProxyTables(ctx, o.NFTables.Kernel)
		if err != nil {
			return err
		}
		if len(tables) > 0 {
			return nil
		}
		runner := o.Runner
		if runner == nil {
			runner = iptables.ExecRunner{}
		}
		if _, err := iptables.DetectMode(ctx, runner); err != nil {
			return nil // it fails only when no iptables tools are installed
		}
		return errors.New("kube-proxy has no nftables table and the node has iptables")
	},
	New: func(ctx context.Context, o Options) (datapath.Backend, error) {
		if len(o.Interfaces) > 0 {
			// masquerade takes the address of whichever device a packet leaves by.
			o.logger().Info("the nftables backend masquerades on every uplink; --interfaces is ignored", "component", "backends")
		}
		return nftables.New(ctx, o.nftables())
	},
	Cleanup: func(ctx context.Context, o Options) (string, error) {
		removed, err := nftables.Cleanup(ctx, o.nftables())
		if err != nil {
			return "", err
		}
		if len(removed) == 0 {
			return fmt.Sprintf("no %s table in nftables", nftables.TableName), nil
		}
		return fmt.Sprintf("table %s removed from %s", nftables.TableName, strings.Join(removed, " and ")), nil
	},
	Read: func(ctx context.Context, o Options, p *policy.Policy) ([]datapath.Reader, error) {
		in, err := nftables.Inspect(ctx, o.NFTables.Kernel, p)
		if err != nil || in == nil {
			if err != nil {
				err = fmt.Errorf("read nftables: %w", err)
			}
			return nil, err
		}
		return []datapath.Reader{in}, nil
	},
	Absent: func(Options) string {
		return fmt.Sprintf("no %s table in nftables", nftables.TableName)
	},
	CountNote: "nftables counts connections: the first packet of each",
	Render:    func(p *policy.Policy, _ Options) string { return nftables.RenderAll(p) },
}

// nftables are the nftables backend's options.
func (o Options) nftables() nftables.Options {
	n := o.NFTables
	n.Logger = o.Logger
	return n
}
