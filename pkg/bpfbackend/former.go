package bpfbackend

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/uplink"
)

// Former uplinks.
//
// A device stops being an uplink when its routes go, and also when the policy changes: a route
// makes an uplink only toward destinations the policy may masquerade, so a configuration that
// keeps them (nonMasqueradeCIDRs) takes the device out while connections masqueraded out of it
// are open. Conntrack keeps a MASQUERADE binding until the connection ends, whatever the rules
// say now, and drops it only when its device goes down or loses the address (nf_nat_masquerade's
// notifiers). So a former uplink whose device is up, still has its SNAT address and still routes
// flows masqueraded to that address keeps the programs and its uplink_snat entry: it drains.
// Once no such flow is left (the sweep ends them), or the device goes down or loses the
// address, it is detached and its flows flushed, as before. New flows there meet the programs
// under the policy in force, which leaves them alone: iptables' POSTROUTING sees every device
// too. The NAT entries do not record the device a flow left by, so a flow counts for a former
// uplink when it is masqueraded to the device's SNAT address and the device has a route toward
// its remote end; the per-packet path is unchanged.

// dropStale removes our programs and SNAT addresses from devices that are not uplinks any more:
// the devices uplink_snat holds (every device the programs were attached to got an entry there)
// and those with a tcx link pin. Other devices are not looked at, so an apply costs the same on
// a node with thousands of pod devices; cleanup looks at them all. A former uplink whose flows
// still use it drains instead (former.go): it keeps the programs, attached again if they went,
// and the SNAT addresses still on it. The flows of an address another uplink still has (held)
// are never flushed.
func (b *Backend) dropStale(ctx context.Context, dp *bpf.Datapath, ups []uplink.Uplink, held []netip.Addr) error {
	snat, err := dp.Uplinks()
	if err != nil {
		return err
	}
	pinned, err := b.attach.Pinned()
	if err != nil {
		return err
	}
	if b.migration != nil && slices.ContainsFunc(b.migration.Sources(), bpf.Source.Newer) {
		// The newer agent's uplinks are in maps this agent cannot read: its programs are
		// looked for on every device, once.
		all, err := b.attach.List(ctx)
		if err != nil {
			return err
		}
		for _, a := range all {
			pinned = append(pinned, a.Ifindex)
		}
	}
	b.mu.Lock()
	was := b.draining
	b.mu.Unlock()
	var draining []former // stored once all are seen: on an error, the former uplinks stay listed
	progs := tc.Programs{Egress: dp.Egress(), Ingress: dp.Ingress()}
	for _, i := range slices.Compact(slices.Sorted(slices.Values(append(slices.Collect(maps.Keys(snat)), pinned...)))) {
		if slices.ContainsFunc(ups, func(u uplink.Uplink) bool { return u.Index == i }) {
			continue
		}
		cur, ok := snat[i]
		f, why, err := assessFormer(ctx, dp, b.resolve, i, cur, ok, true)
		if err != nil {
			return err
		}
		before := slices.ContainsFunc(was, func(w former) bool { return w.Index == i })
		if why == "" {
			if _, err := dp.SetUplinkHolding(i, f.snatOf(), held); err != nil {
				return err
			}
			if err := b.attachTo(ctx, f.Uplink, progs, true); err != nil {
				return fmt.Errorf("attach to %s: %w", f.Name, err)
			}
			draining = append(draining, f)
			if !before {
				b.log.Info("a former uplink drains: it keeps the programs while flows masqueraded out of it last, as conntrack keeps their bindings",
					"uplink", f.String(), "flows", f.flows)
			}
			continue
		}
		if err := b.attach.Detach(ctx, i); err != nil {
			return err
		}
		n, err := dp.RemoveUplinkHolding(i, held)
		if err != nil {
			return err
		}
		b.log.Info("a former uplink is left: programs detached, its flows flushed", "uplink", f.Name, "ifindex", i,
			"why", why, "flushedEntries", n)
	}
	b.mu.Lock()
	b.draining = draining
	b.mu.Unlock()
	return nil
}

// checkDraining, at each tick of the sweep, asks for an apply when a former uplink that drains
// is to go: its device or address went (which the uplink watcher does not follow, the device
// being no uplink), or, when count (once a walk of the sweep is over: only the sweep ends flows),
// its flows are over. Counting them reads every entry, as a walk does: in a large table not at
// every tick, which the walk itself is paced over.
func (b *Backend) checkDraining(ctx context.Context, dp *bpf.Datapath, count bool) {
	b.mu.Lock()
	draining := b.draining
	b.mu.Unlock()
	if len(draining) == 0 {
		return
	}
	res, err := uplink.NewResolver(nil)
	if err != nil {
		b.log.Warn("cannot check the former uplinks", "error", err)
		return
	}
	defer res.Close()
	for _, f := range draining {
		why, err := func() (string, error) {
			cur, ok, err := dp.Uplink(f.Index)
			if err != nil {
				return "", err
			}
			f, why, err := assessFormer(ctx, dp, res, f.Index, cur, ok, count)
			if count && why == "" {
				b.log.Debug("a former uplink drains", "uplink", f.Name, "flows", f.flows)
			}
			return why, err
		}()
		if err != nil {
			b.log.Warn("cannot check a former uplink", "uplink", f.Name, "error", err)
			continue
		}
		if why != "" {
			b.askApply("former uplink " + f.Name + ": " + why)
			return
		}
	}
}

// viaDraining is the Via of a former uplink that drains (datapath.Uplink).
const viaDraining = "former uplink, draining"

// former is a device that is no uplink any more but keeps the programs while its flows last.
type former struct {
	// Uplink is the device, with the SNAT addresses it keeps (those still on it) and its MAC.
	uplink.Uplink
	// flows are the flows masqueraded to them that it still routes.
	flows int
}

func (f former) note() string {
	flows := "flows"
	if f.flows == 1 {
		flows = "flow"
	}
	return fmt.Sprintf("kept while %d %s of %s last", f.flows, flows, strings.Join(addrsOf(f.Uplink), ", "))
}

func addrsOf(u uplink.Uplink) []string {
	var out []string
	for _, a := range []netip.Addr{u.IPv4, u.IPv6} {
		if a.IsValid() {
			out = append(out, a.String())
		}
	}
	return out
}

// assessFormer tells what becomes of the device of ifindex, no uplink any more, whose
// uplink_snat entry is snat (ok false: it has none): why it goes ("" while it drains), and
// what it keeps while it drains; its flows are counted when count, else it drains while its
// device has its address.
func assessFormer(ctx context.Context, dp *bpf.Datapath, res *uplink.Resolver, ifindex int, snat bpf.Uplink, ok, count bool) (former, string, error) {
	f := former{Uplink: uplink.Uplink{Name: "?", Index: ifindex, MAC: snat.MAC}}
	if !ok {
		return f, "it has no SNAT address", nil
	}
	dev, err := res.Device(ctx, ifindex)
	if err != nil {
		return f, "", err
	}
	switch {
	case dev.Name == "":
		return f, "the device is gone", nil
	case !dev.Up:
		f.Name = dev.Name
		return f, "the device is down", nil
	}
	f.Name = dev.Name
	for _, a := range []netip.Addr{snat.IPv4, snat.IPv6} {
		if !a.IsValid() || !slices.Contains(dev.Addrs, a) {
			continue
		}
		if count {
			n, err := dp.MasqueradedFlows(a, dev.Reaches)
			if err != nil {
				return f, "", err
			}
			f.flows += n
		}
		if a.Is4() {
			f.IPv4 = a
		} else {
			f.IPv6 = a
		}
	}
	switch {
	case !f.IPv4.IsValid() && !f.IPv6.IsValid():
		return f, "its SNAT address is gone", nil
	case count && f.flows == 0:
		return f, "no flow uses it any more", nil
	}
	return f, "", nil
}

// snatOf is what uplink_snat keeps for a former uplink that drains.
func (f former) snatOf() bpf.Uplink {
	return bpf.Uplink{IPv4: f.IPv4, IPv6: f.IPv6, MAC: f.MAC}
}
