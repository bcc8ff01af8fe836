package bpf

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/cilium/ebpf"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Uplink is the SNAT addresses of an uplink device; an invalid (zero) address means none of
// that family, and masquerading packets of that family on the device are dropped. MAC is the
// device's own MAC address (uplink_macs): only frames with it as their source can be the node's
// (bpf/scope.h); zero means none is known, and frames are not checked for it.
type Uplink struct {
	IPv4, IPv6 netip.Addr
	MAC        MAC
}

// MAC is an Ethernet address.
type MAC [6]byte

func (m MAC) String() string { return net.HardwareAddr(m[:]).String() }

// MACOf converts a device's hardware address; an address that is not 6 bytes long (a device
// without Ethernet) is the zero MAC.
func MACOf(hw net.HardwareAddr) MAC {
	var m MAC
	if len(hw) == len(m) {
		copy(m[:], hw)
	}
	return m
}

func uplinkValue(u Uplink) masqUplink {
	var v masqUplink
	if u.IPv4.IsValid() {
		v.V4, v.HasV4 = u.IPv4.Unmap().As4(), 1
	}
	if u.IPv6.IsValid() {
		v.V6, v.HasV6 = u.IPv6.As16(), 1
	}
	return v
}

func uplinkOf(v *masqUplink) Uplink {
	var u Uplink
	if v.HasV4 != 0 {
		u.IPv4 = netip.AddrFrom4(v.V4)
	}
	if v.HasV6 != 0 {
		u.IPv6 = netip.AddrFrom16(v.V6)
	}
	return u
}

// SetUplink sets the SNAT addresses of the device with ifindex. When an address changes, the
// flows translated to the old one are flushed (they could not get replies any more); the
// number of entries removed is returned.
func (d *Datapath) SetUplink(ifindex int, u Uplink) (int, error) {
	return d.SetUplinkHolding(ifindex, u, nil)
}

// SetUplinkHolding is SetUplink where held are addresses the node still has: the flows of a
// previous SNAT address among them keep it, as conntrack keeps a flow's binding when the rule
// that made it changes (a masqueradeAddress changed); only an address gone takes its flows.
func (d *Datapath) SetUplinkHolding(ifindex int, u Uplink, held []netip.Addr) (int, error) {
	if u.IPv4.IsValid() && !u.IPv4.Unmap().Is4() {
		return 0, fmt.Errorf("set uplink %d: %s is not an IPv4 address", ifindex, u.IPv4)
	}
	if u.IPv6.IsValid() && (!u.IPv6.Is6() || u.IPv6.Is4In6()) {
		return 0, fmt.Errorf("set uplink %d: %s is not an IPv6 address", ifindex, u.IPv6)
	}
	old, _, err := d.Uplink(ifindex)
	if err != nil {
		return 0, err
	}
	// The MAC first: frames are checked against it only once it is there, so a new uplink is
	// never checked against a stale one.
	if err := d.setMAC(ifindex, u.MAC); err != nil {
		return 0, err
	}
	v := uplinkValue(u)
	if err := d.objs.UplinkSnat.Put(uint32(ifindex), &v); err != nil {
		return 0, fmt.Errorf("set uplink %d: write uplink_snat: %w", ifindex, err)
	}
	return d.flushChanged(old, u, held)
}

// setMAC writes a device's uplink_macs entry, or removes it for the zero MAC.
func (d *Datapath) setMAC(ifindex int, m MAC) error {
	if m == (MAC{}) {
		if err := d.objs.UplinkMacs.Delete(uint32(ifindex)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return fmt.Errorf("set uplink %d: remove from uplink_macs: %w", ifindex, err)
		}
		return nil
	}
	if err := d.objs.UplinkMacs.Put(uint32(ifindex), masqUplinkMac{Addr: m}); err != nil {
		return fmt.Errorf("set uplink %d: write uplink_macs: %w", ifindex, err)
	}
	return nil
}

// mac reads a device's uplink_macs entry (zero when there is none).
func (d *Datapath) mac(ifindex int) (MAC, error) {
	var v masqUplinkMac
	if err := d.objs.UplinkMacs.Lookup(uint32(ifindex), &v); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return MAC{}, nil
		}
		return MAC{}, fmt.Errorf("read uplink_macs of %d: %w", ifindex, err)
	}
	return v.Addr, nil
}

// RemoveUplinkHolding forgets a device and flushes the flows translated to its addresses, but
// those of held, addresses other uplinks still translate to: their flows stay. A flow's entry
// does not say which device it left by, so flushing the address of a device gone would take
// the flows of every other uplink sharing it (a masqueradeAddress is every uplink's) with it.
func (d *Datapath) RemoveUplinkHolding(ifindex int, held []netip.Addr) (int, error) {
	old, ok, err := d.Uplink(ifindex)
	if err != nil || !ok {
		return 0, err
	}
	if err := d.objs.UplinkSnat.Delete(uint32(ifindex)); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return 0, fmt.Errorf("remove uplink %d: %w", ifindex, err)
	}
	if err := d.setMAC(ifindex, MAC{}); err != nil {
		return 0, err
	}
	return d.flushChanged(old, Uplink{}, held)
}

func (d *Datapath) flushChanged(old, cur Uplink, held []netip.Addr) (int, error) {
	n := 0
	for _, pair := range [][2]netip.Addr{{old.IPv4, cur.IPv4}, {old.IPv6, cur.IPv6}} {
		if pair[0].IsValid() && pair[0] != pair[1] && !slices.Contains(held, pair[0]) {
			m, err := d.FlushAddr(pair[0])
			n += m
			if err != nil {
				return n, err
			}
		}
	}
	return n, nil
}

// Uplink reads the SNAT addresses of a device.
func (d *Datapath) Uplink(ifindex int) (Uplink, bool, error) {
	var v masqUplink
	if err := d.objs.UplinkSnat.Lookup(uint32(ifindex), &v); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return Uplink{}, false, nil
		}
		return Uplink{}, false, fmt.Errorf("read uplink %d: %w", ifindex, err)
	}
	u := uplinkOf(&v)
	mac, err := d.mac(ifindex)
	if err != nil {
		return Uplink{}, false, err
	}
	u.MAC = mac
	return u, true, nil
}

// Uplinks reads the SNAT addresses of every device the maps hold, by ifindex: every device the
// programs were attached to has an entry until RemoveUplinkHolding.
func (d *Datapath) Uplinks() (map[int]Uplink, error) {
	out := map[int]Uplink{}
	if err := eachEntry(d.objs.UplinkSnat, func(idx uint32, v *masqUplink) { out[int(idx)] = uplinkOf(v) }); err != nil {
		return nil, fmt.Errorf("read uplink_snat: %w", err)
	}
	for idx, u := range out {
		var err error
		if u.MAC, err = d.mac(idx); err != nil {
			return nil, err
		}
		out[idx] = u
	}
	return out, nil
}

// FlushAddr removes every flow translated to or from addr (an uplink's previous SNAT address):
// masqueraded and host flows whose translated source is addr, with both halves.
func (d *Datapath) FlushAddr(addr netip.Addr) (int, error) {
	addr = addr.Unmap()
	fam := policy.FamilyOf(addr)
	var doomed []NATEntry
	if err := d.NATEntries(fam, func(e NATEntry) bool {
		switch {
		case e.Kind == KindInbound:
		case e.Dir == Egress && e.To.Addr() == addr:
			doomed = append(doomed, e)
		case e.Dir == Ingress && e.Dst.Addr() == addr:
			doomed = append(doomed, e)
		}
		return true
	}); err != nil {
		return 0, fmt.Errorf("flush %s: %w", addr, err)
	}
	if err := d.deleteEntries(fam, doomed); err != nil {
		return 0, fmt.Errorf("flush %s: %w", addr, err)
	}
	return len(doomed), nil
}

// MasqueradedFlows counts the flows masqueraded to addr (one per flow: its egress half) whose
// remote end through accepts (every one when through is nil).
func (d *Datapath) MasqueradedFlows(addr netip.Addr, through func(remote netip.Addr) bool) (int, error) {
	addr = addr.Unmap()
	n := 0
	if err := d.NATEntries(policy.FamilyOf(addr), func(e NATEntry) bool {
		if e.Kind == KindMasq && e.Dir == Egress && e.To.Addr() == addr && (through == nil || through(e.Dst.Addr())) {
			n++
		}
		return true
	}); err != nil {
		return 0, fmt.Errorf("count the flows of %s: %w", addr, err)
	}
	return n, nil
}
