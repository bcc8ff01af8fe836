package uplink

import (
	"errors"
	"fmt"
	"net"
	"slices"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// Nexthop objects (`ip nexthop`; route daemons such as FRR install their routes with them): a
// route may name its next hops by the id of a nexthop object (`ip route add ... nhid 7`)
// rather than carry them. A route dump adds the object's next hops to the route as well unless
// net.ipv4.nexthop_compat_mode is 0 (a sysctl of each network namespace, for both families);
// then it carries the id alone (RTA_NH_ID), which the netlink library (v1.3.1) does not read:
// it knows no nexthop objects. Such routes are read here, from a dump of their own, and their
// next hops found among the nexthop objects (RTM_GETNEXTHOP): a single one (a device, maybe a
// gateway of either family), or a group (ECMP or resilient) of single ones. A blackhole
// nexthop has no device, and makes no uplink, as a blackhole route makes none. Nexthop
// events make Watch read the uplinks again (watch.go): with compat mode off, a nexthop object
// that changes its device brings no route event.

// Netlink attributes that golang.org/x/sys/unix lacks (linux/rtnetlink.h, linux/nexthop.h).
const (
	rtaNHID = 30 // RTA_NH_ID: the nexthop object a route goes by
	nhaFDB  = 11 // NHA_FDB: a nexthop of the bridge's forwarding database, never a route's
)

// nexthop is a nexthop object: a device and maybe a gateway, or the ids of a group's members.
type nexthop struct {
	index int
	gw    net.IP
	group []uint32
}

// nexthops reads the nexthop objects by id; none on a kernel without them (before 5.3).
func (r *Resolver) nexthops() (map[uint32]nexthop, error) {
	req := nl.NewNetlinkRequest(unix.RTM_GETNEXTHOP, unix.NLM_F_DUMP)
	req.Sockets = r.raw
	req.AddRawData(make([]byte, unix.SizeofNhmsg)) // family 0: both
	out := map[uint32]nexthop{}
	var parseErr error
	err := req.ExecuteIter(unix.NETLINK_ROUTE, unix.RTM_NEWNEXTHOP, func(m []byte) bool {
		if len(m) < unix.SizeofNhmsg {
			parseErr = fmt.Errorf("nexthop message of %d bytes", len(m))
			return false
		}
		attrs, err := nl.ParseRouteAttr(m[unix.SizeofNhmsg:])
		if err != nil {
			parseErr = fmt.Errorf("nexthop message: %w", err)
			return false
		}
		var id uint32
		var nh nexthop
		for _, a := range attrs {
			switch a.Attr.Type {
			case unix.NHA_ID:
				id = u32(a.Value)
			case unix.NHA_OIF:
				nh.index = int(u32(a.Value))
			case unix.NHA_GATEWAY:
				nh.gw = net.IP(slices.Clone(a.Value))
			case unix.NHA_GROUP:
				for v := a.Value; len(v) >= unix.SizeofNexthopGrp; v = v[unix.SizeofNexthopGrp:] {
					nh.group = append(nh.group, u32(v))
				}
			case nhaFDB:
				return true
			}
		}
		if id != 0 {
			out[id] = nh
		}
		return true
	})
	if errors.Is(err, unix.EOPNOTSUPP) {
		return nil, nil
	}
	return out, errors.Join(err, parseErr)
}

// idRoutes calls fn with each route of family fam that names a nexthop object and carries no
// next hop of its own (the dumps of compat mode off), with the next hops of the object in
// nhs: its device and gateway, or a group's as a multipath route's. Cloned routes are left
// out, as the library leaves them out of its lists.
func (r *Resolver) idRoutes(fam int, nhs map[uint32]nexthop, fn func(netlink.Route)) error {
	req := nl.NewNetlinkRequest(unix.RTM_GETROUTE, unix.NLM_F_DUMP)
	req.Sockets = r.raw
	req.AddData(&nl.RtMsg{RtMsg: unix.RtMsg{Family: uint8(fam)}})
	var parseErr error
	err := req.ExecuteIter(unix.NETLINK_ROUTE, unix.RTM_NEWROUTE, func(m []byte) bool {
		msg := nl.DeserializeRtMsg(m)
		if int(msg.Family) != fam || msg.Flags&unix.RTM_F_CLONED != 0 {
			return true
		}
		attrs, err := nl.ParseRouteAttr(m[msg.Len():])
		if err != nil {
			parseErr = fmt.Errorf("route message: %w", err)
			return false
		}
		rt := netlink.Route{Family: fam, Table: int(msg.Table), Type: int(msg.Type)}
		var id uint32
		for _, a := range attrs {
			switch a.Attr.Type {
			case unix.RTA_TABLE:
				rt.Table = int(u32(a.Value))
			case unix.RTA_DST:
				rt.Dst = &net.IPNet{IP: net.IP(slices.Clone(a.Value)), Mask: net.CIDRMask(int(msg.Dst_len), 8*len(a.Value))}
			case unix.RTA_PREFSRC:
				rt.Src = net.IP(slices.Clone(a.Value))
			case rtaNHID:
				id = u32(a.Value)
			case unix.RTA_OIF, unix.RTA_MULTIPATH:
				return true // the next hops are in the route: the library reads them
			}
		}
		nh, ok := nhs[id]
		if id == 0 || !ok {
			return true
		}
		if nh.group == nil {
			rt.LinkIndex, rt.Gw = nh.index, nh.gw
		}
		for _, mid := range nh.group {
			if m, ok := nhs[mid]; ok {
				rt.MultiPath = append(rt.MultiPath, &netlink.NexthopInfo{LinkIndex: m.index, Gw: m.gw})
			}
		}
		fn(rt)
		return true
	})
	return errors.Join(err, parseErr)
}

func u32(b []byte) uint32 {
	if len(b) < 4 {
		return 0
	}
	return nl.NativeEndian().Uint32(b)
}
