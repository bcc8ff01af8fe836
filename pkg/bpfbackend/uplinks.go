package bpfbackend

import (
	"context"
	"slices"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/uplink"
)

var (
	_ datapath.UplinkReporter = (*Backend)(nil)
	_ datapath.UplinkReporter = (*Reader)(nil)
)

// Uplinks implements datapath.UplinkReporter: the uplinks the last Apply attached to, the former
// uplinks that drain, and the devices without an Ethernet header it found pod traffic routed
// through.
func (b *Backend) Uplinks(ctx context.Context) ([]datapath.Uplink, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return coverage(b.uplinks, uplink.Set{Uplinks: b.uplinks, Unsupported: b.unsupported}, b.draining), nil
}

// Uplinks implements datapath.UplinkReporter: the uplinks as the routes (and the interfaces the
// reader was given) make them now, against those the programs are attached to; an attached
// device that is no uplink now drains while its flows last (as the agent judges it: former.go).
func (r *Reader) Uplinks(ctx context.Context) ([]datapath.Uplink, error) {
	res, err := uplink.NewResolver(r.interfaces)
	if err != nil {
		return nil, err
	}
	defer res.Close()
	if r.p != nil {
		res.SetScope(r.p.MayMasquerade)
	}
	set, err := res.Resolve(ctx)
	if err != nil {
		return nil, err
	}
	attached := installedUplinks(r.dp)
	var draining []former
	for _, u := range attached {
		if slices.ContainsFunc(set.Uplinks, func(s uplink.Uplink) bool { return s.Index == u.Index }) {
			continue
		}
		f, why, err := assessFormer(ctx, r.dp, res, u.Index, bpf.Uplink{IPv4: u.IPv4, IPv6: u.IPv6}, true)
		if err != nil {
			return nil, err
		}
		if why == "" {
			draining = append(draining, f)
		}
	}
	return coverage(attached, set, draining), nil
}

// Notes of uncovered uplinks.
const (
	noteUnsupported = "no Ethernet header: the programs cannot run there"
	noteNotAttached = "not attached (yet): the agent attaches at its next apply"
)

// coverage reports the devices of set, those that drain, and those attached to, whether or not
// set has them: covered where the programs are attached, by ifindex.
func coverage(attached []uplink.Uplink, set uplink.Set, draining []former) []datapath.Uplink {
	var out []datapath.Uplink
	seen := map[int]bool{}
	for _, u := range set.Uplinks {
		seen[u.Index] = true
		d := datapath.Uplink{Device: u.Name, Ifindex: u.Index, Via: u.Via, Covered: true}
		if !slices.ContainsFunc(attached, func(a uplink.Uplink) bool { return a.Index == u.Index }) {
			d.Covered, d.Note = false, noteNotAttached
		}
		out = append(out, d)
	}
	for _, u := range set.Unsupported {
		seen[u.Index] = true
		out = append(out, datapath.Uplink{Device: u.Name, Ifindex: u.Index, Via: u.Via, Note: noteUnsupported})
	}
	for _, f := range draining {
		seen[f.Index] = true
		out = append(out, datapath.Uplink{Device: f.Name, Ifindex: f.Index, Via: viaDraining, Covered: true, Note: f.note()})
	}
	for _, u := range attached {
		if !seen[u.Index] {
			out = append(out, datapath.Uplink{Device: u.Name, Ifindex: u.Index, Via: "attached; no route makes it an uplink now", Covered: true})
		}
	}
	slices.SortFunc(out, func(a, b datapath.Uplink) int { return a.Ifindex - b.Ifindex })
	return out
}
