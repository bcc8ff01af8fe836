package bpfbackend

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/uplink"
)

var (
	_ datapath.UplinkReporter = (*Backend)(nil)
	_ datapath.UplinkReporter = (*Installed)(nil)
	_ datapath.ChangeReporter = (*Backend)(nil)
)

// Changes carries uplink changes (an uplink appeared or went away, an address changed); each one
// should lead to an Apply, which installs the uplinks as the watcher last read them
// (agent.Options.Changes).
func (b *Backend) Changes() <-chan string { return b.changes }

// uplinksChanged is what the watcher calls with each change: the next Apply uses cur, and is
// asked for through Changes. While a reason waits there, later ones are dropped: the Apply it
// leads to uses the newest resolution anyway.
func (b *Backend) uplinksChanged(reason string, cur uplink.Set) {
	b.watched.Store(&cur)
	b.askApply(reason)
}

// askApply asks for an Apply through Changes, for reason.
func (b *Backend) askApply(reason string) {
	select {
	case b.changes <- reason:
	default:
	}
}

// resolveUplinks returns the uplinks under a policy whose scope (policy.Policy.MayMasquerade)
// says where routes make uplinks: as the watcher read them when it last saw them change, if no
// Apply used that yet and the policy is the one in force (inForce), else read now. Having none
// is an error.
func (b *Backend) resolveUplinks(ctx context.Context, scope func(netip.Prefix) bool, inForce bool) (uplink.Set, error) {
	b.resolve.SetScope(scope)
	b.watchRes.SetScope(scope)
	set := b.watched.Swap(nil)
	if set == nil || !inForce {
		cur, err := b.resolve.Resolve(ctx)
		if err != nil {
			return uplink.Set{}, err
		}
		set = &cur
	}
	if len(set.Missing) > 0 && !slices.Equal(set.Missing, b.missing) {
		b.log.Warn("uplinks named by --interfaces do not exist (yet); they are attached when they appear", "missing", set.Missing)
	}
	b.missing = set.Missing
	b.mu.Lock()
	was := b.unsupported
	b.unsupported = set.Unsupported
	b.mu.Unlock()
	if names := uplinkNames(set.Unsupported); len(names) > 0 && !slices.Equal(names, uplinkNames(was)) {
		b.log.Warn("devices that pod traffic leaves by have no Ethernet header, which the programs cannot parse: "+
			"pod traffic leaving by them is not masqueraded (use the iptables or nftables backend on such a node)",
			"devices", names)
	}
	if len(set.Uplinks) == 0 {
		if len(b.opts.Interfaces) > 0 && !strings.HasPrefix(b.opts.Interfaces[0], "!") {
			return uplink.Set{}, fmt.Errorf("no uplink: none of --interfaces %s exists", strings.Join(b.opts.Interfaces, ","))
		}
		return uplink.Set{}, errors.New("no uplink: no default route, and no route toward a masqueraded destination")
	}
	return *set, nil
}

// masquerading is what the uplinks' SNAT addresses take from a policy: its masquerade address of
// each family (invalid where it has none), and whether it masquerades IPv6.
type masquerading struct {
	v4, v6 netip.Addr
	ipv6   bool
}

func masqueradingOf(p *policy.Policy) masquerading {
	return masquerading{v4: p.MasqueradeAddress, v6: p.MasqueradeAddressIPv6, ipv6: p.Enabled(policy.IPv6)}
}

// snatAddrs is what uplink_snat (and uplink_macs) hold for u: for each family, the policy's
// masquerade address when it has one, else u's own; IPv6 only where the policy masquerades
// IPv6. A masquerade address is thus every uplink's, as iptables' SNAT rule applies to every
// device (the agent checked it is one of the node's uplinks'), and host flows from it keep their
// ports as they do from an uplink's own address. This build's programs read the masquerade
// address in nat_config (bpf.Datapath.SyncPolicy writes it); uplink_snat holds it too for the
// programs of earlier builds of the layout, and so that an address change flushes the flows of
// the old.
func (m masquerading) snatAddrs(u uplink.Uplink) bpf.Uplink {
	addrs := bpf.Uplink{IPv4: cmp.Or(m.v4, u.IPv4), MAC: u.MAC}
	if m.ipv6 {
		addrs.IPv6 = cmp.Or(m.v6, u.IPv6)
	}
	return addrs
}

// heldAddrs are the addresses of the uplinks of set: the flows translated to one of them are not
// flushed when another uplink stops using it.
func heldAddrs(set uplink.Set) []netip.Addr {
	var held []netip.Addr
	for _, addrs := range set.Addrs {
		held = append(held, addrs...)
	}
	return held
}

// install writes each uplink's SNAT addresses and attaches the programs to it: the swap of a
// migration, which catches up first. changed tells that the uplinks differ from the last
// Apply's: a missing address is then warned about. The flows of an SNAT address the policy no
// longer uses, but that is still one of the uplinks' (held: a masqueradeAddress changed), keep
// it, as conntrack's do; an address gone takes its flows.
func (b *Backend) install(ctx context.Context, dp *bpf.Datapath, m masquerading, set uplink.Set, held []netip.Addr, changed bool) error {
	if b.migration != nil {
		// The old programs still run: what they did during the migration's first pass goes in
		// right before the swap.
		if err := b.migration.CatchUp(dp); err != nil {
			return fmt.Errorf("migration: %w", err)
		}
		if err := b.migration.Swapping(); err != nil {
			return fmt.Errorf("migration: %w", err)
		}
	}
	ups := set.Uplinks
	progs := tc.Programs{Egress: dp.Egress(), Ingress: dp.Ingress()}
	b.mu.Lock()
	attached := b.uplinks
	b.mu.Unlock()
	for _, u := range ups {
		snat := m.snatAddrs(u)
		if changed {
			b.warnNoAddress(u, snat, m.ipv6)
		}
		flushed, err := dp.SetUplinkHolding(u.Index, snat, held)
		if err != nil {
			return err
		}
		if flushed > 0 {
			b.log.Info("uplink address changed; flows of the old address flushed", "uplink", u.Name, "entries", flushed)
		}
		if err := b.attachTo(ctx, u, progs, slices.Contains(attached, u)); err != nil {
			return fmt.Errorf("attach to %s: %w", u.Name, err)
		}
	}
	return nil
}

// attachTo makes the uplink run the programs. One that the last successful Apply attached to
// (before) and that still runs them, pins included, is left alone after that check (a query
// per hook: no netlink in tcx mode): attaching again would also look for what the other attach
// mode left on the device, which only an earlier process can have left and which that Apply
// removed. In tcx mode this spares every uplink four netlink requests per apply.
func (b *Backend) attachTo(ctx context.Context, u uplink.Uplink, progs tc.Programs, before bool) error {
	if before {
		st, err := b.attach.Check(ctx, u.Index, progs)
		if err == nil && st.Runs && st.Pinned {
			return nil
		}
	}
	return b.attach.Attach(ctx, u.Index, progs)
}

// warnNoAddress warns when an uplink lacks the SNAT address (snat) of a family it is expected to
// carry: a device named by --interfaces either family, one found by its routes the families of
// its routes; IPv6 only where the policy masquerades it (ipv6).
func (b *Backend) warnNoAddress(u uplink.Uplink, snat bpf.Uplink, ipv6 bool) {
	named := u.Via == uplink.ViaInterfaces
	if (named || u.RoutedV4) && !snat.IPv4.IsValid() {
		b.log.Warn("uplink has no IPv4 address: its masqueraded IPv4 traffic is dropped", "uplink", u.Name)
	}
	if ipv6 && (named || u.RoutedV6) && !snat.IPv6.IsValid() {
		b.log.Warn("uplink has no global IPv6 address: its masqueraded IPv6 traffic is dropped", "uplink", u.Name)
	}
}

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
func (r *Installed) Uplinks(ctx context.Context) ([]datapath.Uplink, error) {
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
		f, why, err := assessFormer(ctx, r.dp, res, u.Index, bpf.Uplink{IPv4: u.IPv4, IPv6: u.IPv6}, true, true)
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
