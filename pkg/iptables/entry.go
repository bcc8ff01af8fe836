package iptables

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Entry is the iptables datapath as the registry lists it: the chain (--masq-chain) in the nat
// table of the node's iptables mode, hooked from POSTROUTING.
var Entry = datapath.Entry{
	Name:       Name,
	Title:      "iptables",
	Installs:   "the iptables chain and its jumps",
	Counts:     "connections: the first packet of each",
	DriftKinds: driftKinds,
	Flags: func(fs *flag.FlagSet) datapath.Settings {
		s := &Settings{}
		fs.StringVar(&s.Chain, "masq-chain", DefaultChain, "name of the nat chain for the iptables backend")
		return s
	},
	New: func(ctx context.Context, e datapath.Env) (datapath.Backend, error) {
		if len(e.Interfaces) > 0 {
			// MASQUERADE takes the address of whichever device a packet leaves by.
			e.Logger.Info("the iptables backend masquerades on every uplink; --interfaces is ignored", "component", "backends")
		}
		s := settingsOf(e)
		return New(ctx, Options{Chain: s.Chain, Runner: s.Runner, Logger: e.Logger})
	},
	Cleanup: func(ctx context.Context, e datapath.Env) (string, error) {
		// A fixed mode skips detection: Cleanup covers both modes anyway. Without the tools of
		// either mode, nothing can have installed a chain through them.
		s := settingsOf(e)
		var missing []string
		for _, mode := range []Mode{ModeNFT, ModeLegacy} {
			b, err := New(ctx, Options{Chain: s.Chain, Mode: mode, Runner: s.Runner, Logger: e.Logger})
			if _, ok := errors.AsType[*MissingToolsError](err); ok {
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
	Read: func(ctx context.Context, e datapath.Env, p *policy.Policy) ([]datapath.Reader, error) {
		s := settingsOf(e)
		installed, err := Inspect(ctx, s.runner(), s.chain(), p)
		if err != nil {
			err = fmt.Errorf("read iptables: %w", err)
		}
		var out []datapath.Reader
		for _, in := range installed {
			out = append(out, in)
		}
		return out, err
	},
	Absent: func(e datapath.Env) string {
		return fmt.Sprintf("no %s chain in iptables-nft or iptables-legacy", settingsOf(e).chain())
	},
	Render: func(p *policy.Policy, e datapath.Env) string { return RenderAll(p, settingsOf(e).chain()) },
}

// Settings are the iptables backend's own settings.
type Settings struct {
	// Chain is --masq-chain; empty means DefaultChain.
	Chain string
	// Runner runs the tools; nil runs them on the node (tests give a fake).
	Runner Runner
}

// Check implements datapath.Settings.
func (s *Settings) Check() error { return ValidateChain(s.chain()) }

func (s *Settings) chain() string {
	if s.Chain == "" {
		return DefaultChain
	}
	return s.Chain
}

func (s *Settings) runner() Runner {
	if s.Runner == nil {
		return ExecRunner{}
	}
	return s.Runner
}

// settingsOf are e's settings of this backend; none are the defaults.
func settingsOf(e datapath.Env) *Settings {
	if s, ok := e.Own.(*Settings); ok {
		return s
	}
	return &Settings{}
}
