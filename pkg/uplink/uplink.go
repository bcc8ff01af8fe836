// Package uplink finds the node's uplinks and their SNAT addresses, and follows them through
// netlink: Watch reports when the set of uplinks or one of their addresses changes.
//
// The uplinks are the devices pod traffic can leave the node by, as iptables' POSTROUTING
// masquerades on whatever device a packet leaves by: those of the default routes, and those of
// the routes toward a destination the policy may masquerade, in every table the node's rules
// select (policy routing, a VPN, a route to one network); see routes.go, and nexthop.go for
// routes through nexthop objects. Routes toward
// networks the policy keeps (Resolver.SetScope) make no uplink. --interfaces names the uplinks
// instead, or, with every entry written !name, takes devices out of that set.
package uplink

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync/atomic"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/rtnl"
)

// Uplink is one device and its SNAT addresses.
type Uplink struct {
	Name  string
	Index int
	// IPv4 and IPv6 are the device's primary addresses (see Resolver.Resolve); invalid when the
	// device has none of that family.
	IPv4, IPv6 netip.Addr
	// RoutedV4 and RoutedV6 tell whether the device carries a route of the family that makes
	// it an uplink (a default route, or one to a destination in scope).
	RoutedV4, RoutedV6 bool
	// MAC is the device's Ethernet address, which the node's stack writes as the source of the
	// frames it sends there; zero for a device without one.
	MAC [6]byte
	// Via says why the device is an uplink: "default route", "route 203.0.113.0/24 table 100",
	// "--interfaces".
	Via string
}

func (u Uplink) String() string {
	var addrs []string
	for _, a := range []netip.Addr{u.IPv4, u.IPv6} {
		if a.IsValid() {
			addrs = append(addrs, a.String())
		}
	}
	if len(addrs) == 0 {
		addrs = []string{"no address"}
	}
	return fmt.Sprintf("%s (ifindex %d, %s)", u.Name, u.Index, strings.Join(addrs, ", "))
}

// Set is the result of a resolution.
type Set struct {
	// Uplinks are ordered by ifindex.
	Uplinks []Uplink
	// Missing are devices named by --interfaces that do not exist (yet).
	Missing []string
	// Unsupported are devices that would be uplinks but have no Ethernet header (a WireGuard
	// or tun VPN, an IP tunnel), which the programs cannot parse: pod traffic leaving by them
	// is not masqueraded. Ordered by ifindex.
	Unsupported []Uplink
	// Addrs are, by ifindex, the addresses of each uplink that traffic can leave from: of
	// global scope and, for IPv6, neither tentative nor failed duplicate address detection (a
	// deprecated one still works), in the kernel's order. A masquerade address must be one
	// (of an uplink its destinations leave by: LeavesBy).
	Addrs map[int][]netip.Addr
	// waiting are the devices that a route would make uplinks once they have an address of
	// its family: Watch follows their addresses too.
	waiting []int
	// routes are the routes of pod traffic that made the resolution (see LeavesBy).
	routes []routeTo
}

// Resolver finds the uplinks in the network namespace it was created in.
type Resolver struct {
	names    []string // --interfaces: exactly these
	excluded []string // --interfaces of !name entries: every route device but these
	scope    atomic.Pointer[func(netip.Prefix) bool]
	nl       *netlink.Handle
	// raw is the socket of the requests the library has no call for (nexthop.go).
	raw map[int]*nl.SocketHandle
}

// CheckInterfaces accepts what --interfaces may say: device names, or names each written !name
// to leave those devices out of the uplinks the routes give; not both.
func CheckInterfaces(spec []string) error {
	_, _, err := parseInterfaces(spec)
	return err
}

func parseInterfaces(spec []string) (names, excluded []string, err error) {
	for _, s := range spec {
		if n, ok := strings.CutPrefix(s, "!"); ok {
			if n == "" {
				return nil, nil, errors.New("interfaces: \"!\" names no device")
			}
			excluded = append(excluded, n)
		} else {
			names = append(names, s)
		}
	}
	if len(names) > 0 && len(excluded) > 0 {
		return nil, nil, fmt.Errorf("interfaces %s: name the uplinks, or leave devices out with !name, not both",
			strings.Join(spec, ","))
	}
	return names, excluded, nil
}

// NewResolver returns a resolver for the devices spec names (--interfaces), or, when it names
// none or only exclusions (!name), for the devices of the routes (see the package comment).
func NewResolver(spec []string) (*Resolver, error) {
	names, excluded, err := parseInterfaces(spec)
	if err != nil {
		return nil, err
	}
	h, err := rtnl.Handle()
	if err != nil {
		return nil, err
	}
	raw, err := rtnl.Socket()
	if err != nil {
		h.Close()
		return nil, err
	}
	return &Resolver{names: names, excluded: excluded, nl: h, raw: map[int]*nl.SocketHandle{unix.NETLINK_ROUTE: raw}}, nil
}

// SetScope tells the resolver which destinations a route must reach to make an uplink, besides
// default routes, which always do: inScope(dst) is false when the policy keeps every address of
// dst. Until it is set, only default routes make uplinks. Safe to call while Resolve runs.
func (r *Resolver) SetScope(inScope func(dst netip.Prefix) bool) { r.scope.Store(&inScope) }

// Close releases the netlink sockets.
func (r *Resolver) Close() {
	r.nl.Close()
	for _, s := range r.raw {
		s.Close()
	}
}

// Resolve reads the uplinks and their addresses.
//
// The SNAT address of a family is, on each device: the preferred source of the route of that
// family that makes it an uplink (its main default route first; see routes.go) when the route
// has one; else its first address (in the kernel's order) of global scope that contains the
// route's gateway; else its first IPv4 address of
// global scope, or its longest-standing IPv6 address of global scope, so that adding an
// address does not move the SNAT address. Secondary IPv4 addresses are skipped, and so are IPv6
// addresses that are tentative, failed duplicate address detection, deprecated or temporary
// (privacy addresses).
func (r *Resolver) Resolve(ctx context.Context) (Set, error) {
	// A dump that the kernel interrupted (the namespace changed meanwhile: pods come and go) may
	// be inconsistent; it is asked again rather than failed or trusted.
	for attempt := 1; ; attempt++ {
		set, err := r.resolve(ctx)
		if !errors.Is(err, netlink.ErrDumpInterrupted) || attempt == dumpAttempts {
			return set, err
		}
	}
}

// dumpAttempts bounds the retries of interrupted netlink dumps.
const dumpAttempts = 5

func (r *Resolver) resolve(ctx context.Context) (Set, error) {
	if err := ctx.Err(); err != nil {
		return Set{}, err
	}
	addrs, err := r.addresses()
	if err != nil {
		return Set{}, err
	}
	routes, to, err := r.routeDevices()
	if err != nil {
		return Set{}, err
	}
	set := Set{routes: to}
	links, err := r.candidates(routes, &set)
	if err != nil {
		return Set{}, err
	}
	set.Addrs = make(map[int][]netip.Addr, len(links))
	for _, l := range links {
		u, ok := r.uplinkOf(l, routes, addrs, &set)
		switch {
		case !ok:
		case l.Attrs().EncapType != "ether":
			set.Unsupported = append(set.Unsupported, u)
		default:
			set.Uplinks = append(set.Uplinks, u)
			set.Addrs[u.Index] = usable(addrs[u.Index][unix.AF_INET], addrs[u.Index][unix.AF_INET6])
		}
	}
	for _, us := range []*[]Uplink{&set.Uplinks, &set.Unsupported} {
		slices.SortFunc(*us, func(a, b Uplink) int { return a.Index - b.Index })
		*us = slices.CompactFunc(*us, func(a, b Uplink) bool { return a.Index == b.Index })
	}
	return set, nil
}

// addresses are the namespace's addresses by ifindex and family: one dump per family, as the
// library lists every address of the namespace for any device's (and filters them itself), so
// asking per device would repeat the dump.
func (r *Resolver) addresses() (map[int]map[int][]netlink.Addr, error) {
	addrs := map[int]map[int][]netlink.Addr{}
	for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
		all, err := r.nl.AddrList(nil, fam)
		if err != nil {
			return nil, fmt.Errorf("list addresses: %w", err)
		}
		for _, a := range all {
			if addrs[a.LinkIndex] == nil {
				addrs[a.LinkIndex] = map[int][]netlink.Addr{}
			}
			addrs[a.LinkIndex][fam] = append(addrs[a.LinkIndex][fam], a)
		}
	}
	return addrs, nil
}

// candidates are the devices that may be uplinks: those --interfaces names (the ones that do
// not exist go to set.Missing), else the devices of the routes, but loopback and those left out.
func (r *Resolver) candidates(routes map[int]map[int]route, set *Set) ([]netlink.Link, error) {
	var links []netlink.Link
	if len(r.names) > 0 {
		for _, name := range r.names {
			l, err := r.nl.LinkByName(name)
			var nf netlink.LinkNotFoundError
			if errors.As(err, &nf) {
				set.Missing = append(set.Missing, name)
				continue
			}
			if err != nil {
				return nil, fmt.Errorf("find device %s: %w", name, err)
			}
			links = append(links, l)
		}
		return links, nil
	}
	for _, idx := range sortedKeys(routes) {
		l, err := r.nl.LinkByIndex(idx)
		var nf netlink.LinkNotFoundError
		if errors.As(err, &nf) {
			continue // gone meanwhile
		}
		if err != nil {
			return nil, fmt.Errorf("find device of ifindex %d: %w", idx, err)
		}
		if l.Attrs().EncapType == "loopback" || slices.Contains(r.excluded, l.Attrs().Name) {
			continue
		}
		links = append(links, l)
	}
	return links, nil
}

// uplinkOf is the uplink device l makes, with its primary address of each family and what
// makes it one, and false when nothing does (a device of the routes whose routes, beyond the
// main default, have no address of their family to masquerade behind: set.waiting).
func (r *Resolver) uplinkOf(l netlink.Link, routes map[int]map[int]route, addrs map[int]map[int][]netlink.Addr, set *Set) (Uplink, bool) {
	u := Uplink{Name: l.Attrs().Name, Index: l.Attrs().Index, Via: ViaInterfaces}
	if hw := l.Attrs().HardwareAddr; len(hw) == len(u.MAC) {
		copy(u.MAC[:], hw)
	}
	var via []string
	for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
		rt, routed := routes[u.Index][fam]
		a := primary(fam, addrs[u.Index][fam], rt)
		if routed && rt.rank != rankMainDefault && !a.IsValid() {
			// A route beyond the main default makes no uplink of a device without an
			// address of its family (a pod's veth): there is nothing to masquerade behind.
			routed = false
			set.waiting = append(set.waiting, u.Index)
		}
		if routed {
			via = append(via, rt.via)
		}
		if fam == unix.AF_INET {
			u.IPv4, u.RoutedV4 = a, routed
		} else {
			u.IPv6, u.RoutedV6 = a, routed
		}
	}
	if len(r.names) == 0 {
		if len(via) == 0 {
			return u, false
		}
		u.Via = strings.Join(slices.Compact(via), ", ")
	}
	return u, true
}

// usable returns the addresses traffic can leave from (see Set.Addrs).
func usable(lists ...[]netlink.Addr) []netip.Addr {
	var out []netip.Addr
	for _, addrs := range lists {
		for _, a := range addrs {
			if a.Scope != unix.RT_SCOPE_UNIVERSE || a.IPNet == nil || a.Flags&(unix.IFA_F_TENTATIVE|unix.IFA_F_DADFAILED) != 0 {
				continue
			}
			if ip, ok := netip.AddrFromSlice(a.IP); ok {
				out = append(out, ip.Unmap())
			}
		}
	}
	return out
}

func primary(fam int, addrs []netlink.Addr, rt route) netip.Addr {
	var cands []netlink.Addr
	for _, a := range addrs {
		if a.Scope != unix.RT_SCOPE_UNIVERSE || a.IPNet == nil {
			continue
		}
		if fam == unix.AF_INET && a.Flags&unix.IFA_F_SECONDARY != 0 {
			continue
		}
		if fam == unix.AF_INET6 && a.Flags&(unix.IFA_F_TENTATIVE|unix.IFA_F_DADFAILED|unix.IFA_F_DEPRECATED|unix.IFA_F_TEMPORARY) != 0 {
			continue
		}
		cands = append(cands, a)
	}
	if fam == unix.AF_INET6 {
		// The kernel lists IPv6 addresses newest first: oldest first instead, so that adding an
		// address does not move the SNAT address.
		slices.Reverse(cands)
	}
	addrOf := func(a netlink.Addr) netip.Addr {
		ip, _ := netip.AddrFromSlice(a.IP)
		return ip.Unmap()
	}
	for _, a := range cands {
		if rt.src.IsValid() && addrOf(a) == rt.src {
			return rt.src
		}
	}
	for _, a := range cands {
		if rt.gw.IsValid() && a.Contains(rt.gw.AsSlice()) {
			return addrOf(a)
		}
	}
	if len(cands) > 0 {
		return addrOf(cands[0])
	}
	return netip.Addr{}
}

func sortedKeys[V any](m map[int]V) []int {
	keys := make([]int, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// Diff describes what changed from old to cur, one phrase per change; empty when nothing did.
func Diff(old, cur Set) []string {
	var out []string
	byIndex := map[int]Uplink{}
	for _, u := range old.Uplinks {
		byIndex[u.Index] = u
	}
	for _, u := range cur.Uplinks {
		o, ok := byIndex[u.Index]
		delete(byIndex, u.Index)
		switch {
		case !ok:
			out = append(out, "uplink "+u.String()+" appeared")
		case o.Name != u.Name:
			out = append(out, fmt.Sprintf("uplink %s renamed %s", o.Name, u.Name))
		}
		if was, now := sortedAddrs(old.Addrs[u.Index]), sortedAddrs(cur.Addrs[u.Index]); ok && !slices.Equal(was, now) {
			out = append(out, fmt.Sprintf("uplink %s addresses %s -> %s", u.Name, showAll(was), showAll(now)))
		}
		if ok {
			for _, f := range []struct {
				name     string
				was, now netip.Addr
			}{{"IPv4", o.IPv4, u.IPv4}, {"IPv6", o.IPv6, u.IPv6}} {
				if f.was != f.now {
					out = append(out, fmt.Sprintf("uplink %s %s address %s -> %s", u.Name, f.name, show(f.was), show(f.now)))
				}
			}
			if o.MAC != u.MAC {
				out = append(out, fmt.Sprintf("uplink %s MAC %s -> %s", u.Name, net.HardwareAddr(o.MAC[:]), net.HardwareAddr(u.MAC[:])))
			}
			if o.Via != u.Via {
				out = append(out, fmt.Sprintf("uplink %s by %s, was by %s", u.Name, u.Via, o.Via))
			}
		}
	}
	for _, idx := range sortedKeys(byIndex) {
		out = append(out, "uplink "+byIndex[idx].Name+" is gone")
	}
	was := map[int]Uplink{}
	for _, u := range old.Unsupported {
		was[u.Index] = u
	}
	for _, u := range cur.Unsupported {
		if _, ok := was[u.Index]; !ok {
			out = append(out, "device "+u.Name+" has routes of pod traffic but no Ethernet header: not masqueraded")
		}
		delete(was, u.Index)
	}
	for _, idx := range sortedKeys(was) {
		out = append(out, "device "+was[idx].Name+" (no Ethernet header) has no routes of pod traffic any more")
	}
	if !slices.Equal(old.Missing, cur.Missing) && len(cur.Missing) > 0 {
		out = append(out, "missing: "+strings.Join(cur.Missing, ", "))
	}
	return out
}

func sortedAddrs(as []netip.Addr) []netip.Addr {
	return slices.SortedFunc(slices.Values(as), netip.Addr.Compare)
}

func showAll(as []netip.Addr) string {
	if len(as) == 0 {
		return "none"
	}
	s := make([]string, len(as))
	for i, a := range as {
		s[i] = a.String()
	}
	return strings.Join(s, ", ")
}

func show(a netip.Addr) string {
	if !a.IsValid() {
		return "none"
	}
	return a.String()
}
