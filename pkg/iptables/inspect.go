package iptables

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Installed is the chain as one iptables mode holds it, read by any process (`dump`), whether
// or not an agent runs. It implements datapath.Reader.
type Installed struct {
	mode   Mode
	chain  string
	runner Runner
	policy *policy.Policy
	// tools of each family whose nat table holds the chain.
	tools map[policy.Family]*tools
}

var _ datapath.Reader = (*Installed)(nil)

// Inspect finds the chain in every mode whose tools are installed, nft first, and returns one
// Installed per mode whose nat table holds it in either family: none when nothing is installed,
// two when both modes hold it (which only happens when agents of both modes ran). p is the
// policy the agent is expected to have installed (its configuration and flags); Counters maps
// the installed lines to its rules. Reading loads no kernel module (iptables-save without -t).
func Inspect(ctx context.Context, r Runner, chain string, p *policy.Policy) ([]*Installed, error) {
	if err := ValidateChain(chain); err != nil {
		return nil, err
	}
	var out []*Installed
	var errs []error
	for _, mode := range []Mode{ModeNFT, ModeLegacy} {
		in := &Installed{mode: mode, chain: chain, runner: r, policy: p, tools: map[policy.Family]*tools{}}
		for _, fam := range []policy.Family{policy.IPv4, policy.IPv6} {
			t, err := resolveTools(ctx, r, mode, fam)
			if err != nil {
				var missing *MissingToolsError
				if !errors.As(err, &missing) {
					errs = append(errs, err)
				}
				continue
			}
			nat, err := readAll(ctx, r, t)
			if err != nil {
				// A kernel without this mode or family holds nothing in it.
				continue
			}
			if nat.HasChain(chain) {
				in.tools[fam] = t
			}
		}
		if len(in.tools) > 0 {
			out = append(out, in)
		}
	}
	if len(out) == 0 && len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return out, nil
}

// readAll reads every table of a mode and family with counters and returns the nat table.
func readAll(ctx context.Context, r Runner, t *tools) (*Table, error) {
	out, err := r.Run(ctx, nil, t.save, "-c")
	if err != nil {
		return nil, fmt.Errorf("read nat table: %w", err)
	}
	return ParseSave(out, "nat")
}

// Mode is the iptables mode that holds the chain.
func (in *Installed) Mode() Mode { return in.mode }

// Info implements datapath.InfoReporter.
func (in *Installed) Info() datapath.Info {
	var fams []string
	for _, fam := range []policy.Family{policy.IPv4, policy.IPv6} {
		if in.tools[fam] != nil {
			fams = append(fams, fam.String())
		}
	}
	return datapath.Info{Backend: Name, AttachMode: datapath.AttachNone,
		Details: fmt.Sprintf("iptables-%s, chain %s (%s)", in.mode, in.chain, strings.Join(fams, ", "))}
}

// Counters implements datapath.Reader: the live counters of each family's chain, summed per rule
// of the policy as the backend's Counters does, then the lines that implement no rule of it,
// one each (Rule 0). The agent drops --random-fully where the node lacks it, so lines are
// matched against the policy with and without it, whichever explains more of them.
func (in *Installed) Counters(ctx context.Context) ([]datapath.RuleCounter, error) {
	var out []datapath.RuleCounter
	for _, fam := range []policy.Family{policy.IPv4, policy.IPv6} {
		t := in.tools[fam]
		if t == nil {
			continue
		}
		nat, err := readAll(ctx, in.runner, t)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", fam, err)
		}
		live := nat.ChainRules(in.chain)
		var counters []datapath.RuleCounter
		var rest []int
		if in.policy != nil {
			counters, rest = mapLines(in.policy, fam, in.chain, live)
			if in.policy.RandomFully {
				plain := *in.policy
				plain.RandomFully = false
				if c, r := mapLines(&plain, fam, in.chain, live); len(r) < len(rest) {
					counters, rest = c, r
				}
			}
		} else {
			for i := range live {
				rest = append(rest, i)
			}
		}
		out = append(out, counters...)
		for _, i := range rest {
			out = append(out, unexplained(fam, live[i]))
		}
	}
	return out, nil
}

// unexplained describes a chain line that implements no rule of the policy: its destination
// (every address when it has none) and whether it masquerades (MASQUERADE or SNAT) or not.
func unexplained(fam policy.Family, r SavedRule) datapath.RuleCounter {
	c := datapath.RuleCounter{Family: fam, Entry: -1, Action: policy.Return, Packets: r.Packets, Bytes: r.Bytes}
	c.Prefix = netip.PrefixFrom(netip.IPv4Unspecified(), 0)
	if fam == policy.IPv6 {
		c.Prefix = netip.PrefixFrom(netip.IPv6Unspecified(), 0)
	}
	f := strings.Fields(r.Text)
	for i := 0; i+1 < len(f); i++ {
		switch f[i] {
		case "-d":
			if p, err := netip.ParsePrefix(f[i+1]); err == nil {
				c.Prefix = p
			} else if a, err := netip.ParseAddr(f[i+1]); err == nil {
				c.Prefix = netip.PrefixFrom(a, a.BitLen())
			}
		case "-j":
			if f[i+1] == "MASQUERADE" || f[i+1] == "SNAT" {
				c.Action = policy.Masquerade
			}
		}
	}
	return c
}
