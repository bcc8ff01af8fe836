// Package uplink finds the node's uplinks (the devices of the default routes, or the devices
// named by --interfaces) and their SNAT addresses, and follows them through netlink: Watch
// reports when the set of uplinks or one of their addresses changes.
package uplink

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// netlinkTimeout bounds every netlink request (the netlink library takes no context).
const netlinkTimeout = 5 * time.Second

// Uplink is one device and its SNAT addresses.
type Uplink struct {
	Name  string
	Index int
	// IPv4 and IPv6 are the device's primary addresses (see Resolver.Resolve); invalid when the
	// device has none of that family.
	IPv4, IPv6 netip.Addr
	// DefaultV4 and DefaultV6 tell whether the device carries a default route of the family.
	DefaultV4, DefaultV6 bool
	// MAC is the device's Ethernet address, which the node's stack writes as the source of the
	// frames it sends there; zero for a device without one.
	MAC [6]byte
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
	// Addrs are, by ifindex, the addresses of each uplink that traffic can leave from: of
	// global scope and, for IPv6, neither tentative nor failed duplicate address detection (a
	// deprecated one still works), in the kernel's order. A masquerade address must be one.
	Addrs map[int][]netip.Addr
}

// Carrier returns the uplink that has the address a (see Addrs).
func (s Set) Carrier(a netip.Addr) (Uplink, bool) {
	for _, u := range s.Uplinks {
		if slices.Contains(s.Addrs[u.Index], a) {
			return u, true
		}
	}
	return Uplink{}, false
}

// Resolver finds the uplinks in the network namespace it was created in.
type Resolver struct {
	names []string
	nl    *netlink.Handle
}

// NewResolver returns a resolver for the named devices, or for the devices of the default
// routes when names is empty.
func NewResolver(names []string) (*Resolver, error) {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink: %w", err)
	}
	if err := h.SetSocketTimeout(netlinkTimeout); err != nil {
		h.Close()
		return nil, fmt.Errorf("netlink: %w", err)
	}
	return &Resolver{names: slices.Clone(names), nl: h}, nil
}

// Close releases the netlink socket.
func (r *Resolver) Close() { r.nl.Close() }

// Resolve reads the uplinks and their addresses.
//
// The SNAT address of a family is, on each device: the preferred source of its default route
// of that family when the device has it; else its first address (in the kernel's order) of
// global scope that contains the default route's gateway; else its first IPv4 address of
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
	defaults, err := r.defaultRoutes()
	if err != nil {
		return Set{}, err
	}
	var set Set
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
				return Set{}, fmt.Errorf("find device %s: %w", name, err)
			}
			links = append(links, l)
		}
	} else {
		for _, idx := range sortedKeys(defaults) {
			l, err := r.nl.LinkByIndex(idx)
			var nf netlink.LinkNotFoundError
			if errors.As(err, &nf) {
				continue // gone meanwhile
			}
			if err != nil {
				return Set{}, fmt.Errorf("find device of ifindex %d: %w", idx, err)
			}
			links = append(links, l)
		}
	}
	// One dump per family for all the uplinks: the library lists every address of the namespace
	// for any device's (and filters them itself), so asking per uplink repeated the dump.
	addrs := map[int]map[int][]netlink.Addr{}
	if len(links) > 0 {
		for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
			all, err := r.nl.AddrList(nil, fam)
			if err != nil {
				return Set{}, fmt.Errorf("list addresses: %w", err)
			}
			for _, a := range all {
				if addrs[a.LinkIndex] == nil {
					addrs[a.LinkIndex] = map[int][]netlink.Addr{}
				}
				addrs[a.LinkIndex][fam] = append(addrs[a.LinkIndex][fam], a)
			}
		}
	}
	set.Addrs = make(map[int][]netip.Addr, len(links))
	for _, l := range links {
		u := Uplink{Name: l.Attrs().Name, Index: l.Attrs().Index}
		if hw := l.Attrs().HardwareAddr; len(hw) == len(u.MAC) {
			copy(u.MAC[:], hw)
		}
		set.Addrs[u.Index] = usable(addrs[u.Index][unix.AF_INET], addrs[u.Index][unix.AF_INET6])
		_, u.DefaultV4 = defaults[u.Index][unix.AF_INET]
		_, u.DefaultV6 = defaults[u.Index][unix.AF_INET6]
		for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
			a := primary(fam, addrs[u.Index][fam], defaults[u.Index][fam])
			if fam == unix.AF_INET {
				u.IPv4 = a
			} else {
				u.IPv6 = a
			}
		}
		set.Uplinks = append(set.Uplinks, u)
	}
	slices.SortFunc(set.Uplinks, func(a, b Uplink) int { return a.Index - b.Index })
	set.Uplinks = slices.CompactFunc(set.Uplinks, func(a, b Uplink) bool { return a.Index == b.Index })
	return set, nil
}

// route is what the address choice needs of a default route.
type route struct {
	src, gw netip.Addr
}

// defaultRoutes returns, by ifindex and family, the default routes of the main table.
func (r *Resolver) defaultRoutes() (map[int]map[int]route, error) {
	out := map[int]map[int]route{}
	for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
		routes, err := r.nl.RouteListFiltered(fam, &netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
		if err != nil {
			return nil, fmt.Errorf("list routes: %w", err)
		}
		for _, rt := range routes {
			if rt.Dst != nil {
				if ones, _ := rt.Dst.Mask.Size(); ones != 0 {
					continue
				}
			}
			if rt.Type != unix.RTN_UNICAST {
				continue // unreachable, blackhole: no device
			}
			add := func(idx int, gw net.IP) {
				if idx <= 0 {
					return
				}
				if out[idx] == nil {
					out[idx] = map[int]route{}
				}
				if _, ok := out[idx][fam]; ok {
					return // the first (best) route of the device counts
				}
				src, _ := netip.AddrFromSlice(rt.Src)
				g, _ := netip.AddrFromSlice(gw)
				out[idx][fam] = route{src: src.Unmap(), gw: g.Unmap()}
			}
			add(rt.LinkIndex, rt.Gw)
			for _, nh := range rt.MultiPath {
				add(nh.LinkIndex, nh.Gw)
			}
		}
	}
	return out, nil
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
		}
	}
	for _, idx := range sortedKeys(byIndex) {
		out = append(out, "uplink "+byIndex[idx].Name+" is gone")
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
