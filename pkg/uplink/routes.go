package uplink

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Routes beyond the default: pod traffic leaves by any route of any table the node's rules
// select (policy routing, a VPN, a route to one network), and iptables' POSTROUTING masquerades
// it on whatever device it leaves by. So the uplinks, unless --interfaces names them, are the
// devices of the default routes of those tables (main's always), and of their other routes
// toward a destination the policy may masquerade (the Resolver's scope), with or without a
// gateway: a second NIC's own subnet is masqueraded as much as what lies behind its router.
// Routes toward networks the policy keeps make no uplink: the pods' own (nonMasqueradeCIDRs
// holds the pod network, as the upstream agent requires), a CNI's toward other nodes' pods.
// Where the policy masquerades toward the pods (IPv6 without nonMasqueradeCIDRs of its family),
// their devices with an address of that family (a bridge, a routed pod veth) are uplinks as
// iptables masquerades there: new flows into the pods leave their device masqueraded, and the
// programs on the device's ingress record the pods' own flows so that their replies pass.

// Reasons a device is an uplink (Uplink.Via), besides the routes': ViaInterfaces, a device
// --interfaces names.
const (
	viaDefault    = "default route"
	ViaInterfaces = "--interfaces"
)

// route is what the uplink choice needs of the route that makes a device an uplink: the address
// choice (its preferred source and gateway), what to say of it, and its rank: the lower the
// better.
type route struct {
	src, gw netip.Addr
	via     string
	rank    int
}

// Ranks of routes: a default route of the main table chooses the SNAT address; a route through
// a gateway says more of the address (the one in the gateway's subnet) than one without.
const (
	rankMainDefault = iota
	rankGateway
	rankOnLink
)

// routeTables are the tables the rules of a family select: main and default always, and every
// table a rule names, but local (the node's own addresses).
func (r *Resolver) routeTables(fam int) ([]int, error) {
	rules, err := r.nl.RuleList(fam)
	if err != nil {
		return nil, err
	}
	tables := []int{unix.RT_TABLE_MAIN, unix.RT_TABLE_DEFAULT}
	for _, rl := range rules {
		if rl.Table > 0 && rl.Table != unix.RT_TABLE_LOCAL && !slices.Contains(tables, rl.Table) {
			tables = append(tables, rl.Table)
		}
	}
	return tables, nil
}

// routeTo is a route of pod traffic: where to, and through which device (one per next hop).
type routeTo struct {
	dst   netip.Prefix
	index int
}

// routeDevices returns, by ifindex and family, the best route (the lowest rank, then the first)
// of each device toward where pod traffic goes, in the tables the rules select, and all those
// routes. Only unicast routes through a device count (not unreachable, blackhole or local ones).
func (r *Resolver) routeDevices() (map[int]map[int]route, []routeTo, error) {
	inScope := func(netip.Prefix) bool { return false }
	if f := r.scope.Load(); f != nil {
		inScope = *f
	}
	out := map[int]map[int]route{}
	var all []routeTo
	add := func(fam, idx int, dst netip.Prefix, rt route) {
		if idx <= 0 {
			return
		}
		all = append(all, routeTo{dst, idx})
		if out[idx] == nil {
			out[idx] = map[int]route{}
		}
		if best, ok := out[idx][fam]; !ok || rt.rank < best.rank {
			out[idx][fam] = rt
		}
	}
	err := r.unicastRoutes(func(fam, t int, dst netip.Prefix, rt netlink.Route) {
		if dst.Bits() > 0 && !inScope(dst) {
			return
		}
		src, _ := netip.AddrFromSlice(rt.Src)
		hop := func(idx int, gw net.IP, via netlink.Destination) {
			g, _ := netip.AddrFromSlice(gw)
			g = g.Unmap()
			c := route{src: src.Unmap(), gw: g, via: describe(dst, t), rank: rankOnLink}
			switch {
			case dst.Bits() == 0 && t == unix.RT_TABLE_MAIN:
				c.rank = rankMainDefault
			case g.IsValid(), via != nil:
				c.rank = rankGateway
			}
			add(fam, idx, dst, c)
		}
		hop(rt.LinkIndex, rt.Gw, rt.Via)
		for _, nh := range rt.MultiPath {
			hop(nh.LinkIndex, nh.Gw, nh.Via)
		}
	})
	if err != nil {
		return nil, nil, err
	}
	return out, all, nil
}

// unicastRoutes calls fn with each unicast route (not unreachable, blackhole or local: those
// have no device) of the tables the rules select, its family, table and destination; a route
// that names a nexthop object comes with the object's next hops (nexthop.go).
func (r *Resolver) unicastRoutes(fn func(fam, table int, dst netip.Prefix, rt netlink.Route)) error {
	nhs, err := r.nexthops()
	if err != nil {
		return fmt.Errorf("list nexthop objects: %w", err)
	}
	for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
		tables, err := r.routeTables(fam)
		if err != nil {
			return fmt.Errorf("list rules: %w", err)
		}
		each := func(rt netlink.Route) {
			if rt.Type == unix.RTN_UNICAST && slices.Contains(tables, rt.Table) {
				fn(fam, rt.Table, prefixOf(fam, rt.Dst), rt)
			}
		}
		for _, t := range tables {
			routes, err := r.nl.RouteListFiltered(fam, &netlink.Route{Table: t}, netlink.RT_FILTER_TABLE)
			if err != nil {
				return fmt.Errorf("list routes of table %d: %w", t, err)
			}
			for _, rt := range routes {
				each(rt)
			}
		}
		if len(nhs) == 0 {
			continue // no route can name one
		}
		if err := r.idRoutes(fam, nhs, each); err != nil {
			return fmt.Errorf("list routes through nexthop objects: %w", err)
		}
	}
	return nil
}

// through tells whether rt leaves by the device of ifindex: its own, or one of a multipath
// route's next hops (whose LinkIndex is 0).
func through(rt netlink.Route, ifindex int) bool {
	return rt.LinkIndex == ifindex ||
		slices.ContainsFunc(rt.MultiPath, func(nh *netlink.NexthopInfo) bool { return nh.LinkIndex == ifindex })
}

// LeavesBy returns the uplinks that traffic toward all of dst leaves by: those of the most
// specific routes that hold dst whole, in the tables the rules select (a default route holds
// every destination of its family). Where several tables hold it as specifically (a rule that
// selects by source), those of each. None when no uplink's route holds dst.
func (s Set) LeavesBy(dst netip.Prefix) []Uplink {
	dst = dst.Masked()
	best, idx := -1, []int(nil)
	for _, rt := range s.routes {
		if rt.dst.Addr().Is4() != dst.Addr().Is4() || rt.dst.Bits() > dst.Bits() || !rt.dst.Contains(dst.Addr()) ||
			!slices.ContainsFunc(s.Uplinks, func(u Uplink) bool { return u.Index == rt.index }) {
			continue
		}
		switch {
		case rt.dst.Bits() > best:
			best, idx = rt.dst.Bits(), []int{rt.index}
		case rt.dst.Bits() == best:
			idx = append(idx, rt.index)
		}
	}
	var out []Uplink
	for _, u := range s.Uplinks {
		if slices.Contains(idx, u.Index) {
			out = append(out, u)
		}
	}
	return out
}

// describe says what a route is, for Via: "default route", "route 198.18.0.0/15 table 100".
func describe(dst netip.Prefix, table int) string {
	s := "route " + dst.String()
	if dst.Bits() == 0 {
		s = viaDefault
	}
	if table != unix.RT_TABLE_MAIN {
		s += fmt.Sprintf(" table %d", table)
	}
	return s
}

func prefixOf(fam int, dst *net.IPNet) netip.Prefix {
	if dst == nil {
		if fam == unix.AF_INET6 {
			return netip.PrefixFrom(netip.IPv6Unspecified(), 0)
		}
		return netip.PrefixFrom(netip.IPv4Unspecified(), 0)
	}
	a, _ := netip.AddrFromSlice(dst.IP)
	ones, _ := dst.Mask.Size()
	return netip.PrefixFrom(a.Unmap(), ones)
}

// relevant tells whether a route (added or deleted) can change the uplinks: a default route, or
// one to a destination in scope, in a table other than local. Routes to the pods themselves do
// not (when the policy keeps them), so pods coming and going cost no resolution.
func (r *Resolver) relevant(rt netlink.Route) bool {
	if rt.Table == unix.RT_TABLE_LOCAL {
		return false
	}
	fam := unix.AF_INET
	if rt.Family == unix.AF_INET6 || (rt.Dst != nil && rt.Dst.IP.To4() == nil) {
		fam = unix.AF_INET6
	}
	dst := prefixOf(fam, rt.Dst)
	if dst.Bits() == 0 {
		return true
	}
	f := r.scope.Load()
	return f != nil && (*f)(dst)
}

// Device is what the node has of one device: for a device that is no uplink any more, whether
// the flows masqueraded out of it can still leave by it (conntrack keeps their bindings until
// the device goes down or loses its address).
type Device struct {
	Name string
	// Up: the device exists and is administratively up.
	Up bool
	// Addrs are its addresses that traffic can leave from (as Set.Addrs).
	Addrs []netip.Addr
	// Routes are the destinations of its unicast routes in the tables the rules select, with
	// those of the multipath routes it is a next hop of.
	Routes []netip.Prefix
}

// Reaches tells whether one of the device's routes holds addr.
func (d Device) Reaches(addr netip.Addr) bool {
	return slices.ContainsFunc(d.Routes, func(p netip.Prefix) bool { return p.Contains(addr) })
}

// Device reads the device of ifindex; a device that does not exist is not Up and has nothing.
func (r *Resolver) Device(ctx context.Context, ifindex int) (Device, error) {
	if err := ctx.Err(); err != nil {
		return Device{}, err
	}
	l, err := r.nl.LinkByIndex(ifindex)
	if _, gone := errors.AsType[netlink.LinkNotFoundError](err); gone {
		return Device{}, nil
	}
	if err != nil {
		return Device{}, fmt.Errorf("find device of ifindex %d: %w", ifindex, err)
	}
	d := Device{Name: l.Attrs().Name, Up: l.Attrs().Flags&net.FlagUp != 0}
	addrs, err := r.nl.AddrList(l, netlink.FAMILY_ALL)
	if err != nil {
		return Device{}, fmt.Errorf("list addresses of %s: %w", d.Name, err)
	}
	d.Addrs = usable(addrs)
	err = r.unicastRoutes(func(_, _ int, dst netip.Prefix, rt netlink.Route) {
		if through(rt, ifindex) {
			d.Routes = append(d.Routes, dst)
		}
	})
	if err != nil {
		return Device{}, err
	}
	return d, nil
}
