package nftables

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Entry is the nftables datapath as the registry lists it: a table of its own per family,
// hooked at nat postrouting. It has no flags; its settings (*Options) are for tests, which give
// fakes of nft and of the kernel.
var Entry = datapath.Entry{
	Name:       Name,
	Title:      "nftables",
	AutoWhen:   "when the node's kube-proxy runs in nftables mode or the node has no iptables",
	Installs:   "the nftables tables",
	Counts:     "connections: the first packet of each",
	DriftKinds: driftKinds,
	// Where kube-proxy writes nftables, its rules and ours are of one kind. Elsewhere the
	// iptables backend's chain sits beside kube-proxy's, hooked as upstream hooks it (and
	// iptables-nft's chains are nftables already): auto comes back to nftables only where the
	// iptables backend cannot run, on a node without iptables.
	Fits: func(ctx context.Context, e datapath.Env) error {
		tables, err := KubeProxyTables(ctx, optionsOf(e).Kernel)
		if err != nil {
			return err
		}
		if len(tables) == 0 {
			return errors.New("kube-proxy has no nftables table")
		}
		return nil
	},
	New: func(ctx context.Context, e datapath.Env) (datapath.Backend, error) {
		if len(e.Interfaces) > 0 {
			// masquerade takes the address of whichever device a packet leaves by.
			e.Logger.Info("the nftables backend masquerades on every uplink; --interfaces is ignored", "component", "backends")
		}
		return New(ctx, optionsOf(e))
	},
	Cleanup: func(ctx context.Context, e datapath.Env) (string, error) {
		removed, err := Cleanup(ctx, optionsOf(e))
		if err != nil {
			return "", err
		}
		if len(removed) == 0 {
			return fmt.Sprintf("no %s table in nftables", TableName), nil
		}
		return fmt.Sprintf("table %s removed from %s", TableName, strings.Join(removed, " and ")), nil
	},
	Read: func(ctx context.Context, e datapath.Env, p *policy.Policy) ([]datapath.Reader, error) {
		in, err := Inspect(ctx, optionsOf(e).Kernel, p)
		if err != nil || in == nil {
			if err != nil {
				err = fmt.Errorf("read nftables: %w", err)
			}
			return nil, err
		}
		return []datapath.Reader{in}, nil
	},
	Absent: func(datapath.Env) string {
		return fmt.Sprintf("no %s table in nftables", TableName)
	},
	Render: func(p *policy.Policy, _ datapath.Env) string { return RenderAll(p) },
}

// Check implements datapath.Settings: no flag sets Options.
func (o *Options) Check() error { return nil }

// optionsOf are the backend's options in e: its settings, with e's logger.
func optionsOf(e datapath.Env) Options {
	var o Options
	if own, ok := e.Own.(*Options); ok {
		o = *own
	}
	o.Logger = e.Logger
	return o
}
