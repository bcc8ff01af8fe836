package bpf

import (
	"testing"
	"time"

	"github.com/gopacket/gopacket/layers"
)

// TestHookSeen: each program stamps its hook's slot with the time it ran, whatever the packet
// (not IP at all included), at most every HookRefresh; the other direction's slot and the other
// devices' slots stay untouched.
func TestHookSeen(t *testing.T) {
	h := newHarness(t, defaultPolicy(false), LoadOptions{})
	if got := h.dp.objs.HookSeen.MaxEntries(); got != 2*HookSlots {
		t.Fatalf("hook_seen has %d entries, want %d: HookSlots differs from bpf/maps.h", got, 2*HookSlots)
	}
	arp := serializeRaw(&layers.Ethernet{SrcMAC: macA, DstMAC: macB, EthernetType: layers.EthernetTypeARP},
		&layers.ARP{AddrType: layers.LinkTypeEthernet, Protocol: layers.EthernetTypeIPv4, HwAddressSize: 6,
			ProtAddressSize: 4, Operation: layers.ARPRequest, SourceHwAddress: macA, SourceProtAddress: []byte{10, 1, 0, 1},
			DstHwAddress: make([]byte, 6), DstProtAddress: []byte{10, 1, 0, 2}})
	seen := func(dir Direction) time.Duration {
		t.Helper()
		d, err := h.dp.HookSeen(testIfindex, dir)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	for _, dir := range []Direction{Egress, Ingress} {
		run := h.egress
		if dir == Ingress {
			run = h.ingress
		}
		before := MonotonicNow()
		if ret, _ := run(arp); ret != tcNext {
			t.Fatalf("%s: verdict %d for ARP", dir, int32(ret))
		}
		after := MonotonicNow()
		if got := seen(dir); got < before || got > after {
			t.Fatalf("%s: hook_seen %v, want within [%v, %v]", dir, got, before, after)
		}
		// Within HookRefresh of the stamp, a packet leaves it as it is.
		stamp := after - HookRefresh/2
		key := uint32(HookSlot(testIfindex)<<1) | uint32(dir)
		if err := h.dp.objs.HookSeen.Put(key, uint64(stamp)); err != nil {
			t.Fatal(err)
		}
		run(arp)
		if got := seen(dir); got != stamp {
			t.Fatalf("%s: a stamp %v old was rewritten (%v)", dir, MonotonicNow()-stamp, got)
		}
		// An older stamp is refreshed.
		if err := h.dp.objs.HookSeen.Put(key, uint64(before-HookRefresh)); err != nil {
			t.Fatal(err)
		}
		run(udpPacket(ap(pod4(1), 1000), ap(remote4, 53), payload))
		if got := seen(dir); got < before {
			t.Fatalf("%s: stale stamp not refreshed: %v < %v", dir, got, before)
		}
	}
	for slot := range 2 * HookSlots {
		if slot == HookSlot(testIfindex)<<1 || slot == HookSlot(testIfindex)<<1|1 {
			continue
		}
		var v uint64
		if err := h.dp.objs.HookSeen.Lookup(uint32(slot), &v); err != nil || v != 0 {
			t.Fatalf("slot %d of no device we ran on: %d %v", slot, v, err)
		}
	}
}
