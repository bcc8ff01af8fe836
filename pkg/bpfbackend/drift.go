package bpfbackend

import (
	"context"
	"errors"
	"slices"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
)

// driftKinds are the kinds of drift CheckDrift reports that an apply repairs.
var driftKinds = []string{datapath.DriftProgram, datapath.DriftPin, datapath.DriftTrie, datapath.DriftNATConfig,
	datapath.DriftUplinkAddr}

// DriftKinds implements datapath.DriftChecker.
func (b *Backend) DriftKinds() []string { return driftKinds }

// CheckDrift implements datapath.DriftChecker, against what the last successful Apply
// installed: the map pins (a stat each), both programs on every uplink (a query per hook) and
// their tcx link pins, each uplink's uplink_snat entry (a lookup), the tries and nat_config
// (bpf.Datapath.CheckPolicy: a bounded walk of the tries), and the uplinks' hooks for a program
// of another component ahead of ours that ends the chain (checkHooks: a query and a counter
// read per device). A former uplink that drains is checked as an uplink, against the SNAT
// addresses it keeps: its flows need the programs. An uplink that is gone is skipped: the
// uplink watcher reports it (the sweep a former uplink's), and the next Apply forgets it.
func (b *Backend) CheckDrift(ctx context.Context) ([]string, error) {
	dp := b.dp.Load()
	if dp == nil || !b.applied {
		return nil, nil
	}
	found := map[string]bool{}
	missing, err := dp.MissingPins()
	if err != nil {
		return nil, err
	}
	found[datapath.DriftPin] = len(missing) > 0
	progs := tc.Programs{Egress: dp.Egress(), Ingress: dp.Ingress()}
	b.mu.Lock()
	ups := slices.Clone(b.uplinks)
	wants := make([]bpf.Uplink, len(ups), len(ups)+len(b.draining))
	masq := masqueradingOf(b.lastApplied)
	for i, u := range ups {
		wants[i] = masq.snatAddrs(u)
	}
	for _, f := range b.draining {
		ups, wants = append(ups, f.Uplink), append(wants, f.snatOf())
	}
	b.mu.Unlock()
	for i, u := range ups {
		idx, want := u.Index, wants[i]
		st, err := b.attach.Check(ctx, idx, progs)
		if errors.Is(err, tc.ErrNoDevice) {
			continue
		}
		if err != nil {
			return nil, err
		}
		found[datapath.DriftProgram] = found[datapath.DriftProgram] || !st.Runs
		found[datapath.DriftPin] = found[datapath.DriftPin] || !st.Pinned
		got, ok, err := dp.Uplink(idx)
		if err != nil {
			return nil, err
		}
		found[datapath.DriftUplinkAddr] = found[datapath.DriftUplinkAddr] || !ok || got != want
	}
	policyDrift, err := dp.CheckPolicy()
	if err != nil {
		return nil, err
	}
	found[datapath.DriftTrie] = len(policyDrift.Tries) > 0
	found[datapath.DriftNATConfig] = policyDrift.NATConfig
	if found[datapath.DriftBypassed], err = b.checkHooks(ctx, dp, ups); err != nil {
		return nil, err
	}
	var out []string
	for _, k := range append(b.DriftKinds(), datapath.DriftBypassed) {
		if found[k] {
			out = append(out, k)
		}
	}
	return out, nil
}
