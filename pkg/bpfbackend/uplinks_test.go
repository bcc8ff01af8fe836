package bpfbackend

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/uplink"
)

// TestCoverage: the uplinks the routes make are covered where the programs are attached and
// say why not elsewhere; devices without Ethernet header are never covered; a former uplink
// that drains is covered and says while what; a device the programs are still attached to that
// no route makes an uplink any more is listed too.
func TestCoverage(t *testing.T) {
	eth0 := uplink.Uplink{Name: "eth0", Index: 2, Via: "default route"}
	eth1 := uplink.Uplink{Name: "eth1", Index: 3, Via: "route 198.18.0.0/15 table 100"}
	wg0 := uplink.Uplink{Name: "wg0", Index: 9, Via: "route 100.64.0.0/10"}
	old := uplink.Uplink{Name: "eth2", Index: 4}
	pod0 := former{Uplink: uplink.Uplink{Name: "pod0", Index: 5, IPv4: netip.MustParseAddr("10.1.0.1"),
		IPv6: netip.MustParseAddr("fd00::1")}, flows: 3}
	got := coverage([]uplink.Uplink{eth0, old, pod0.Uplink}, uplink.Set{Uplinks: []uplink.Uplink{eth0, eth1}, Unsupported: []uplink.Uplink{wg0}},
		[]former{pod0})
	want := []string{
		"eth0 2 default route true ",
		"eth1 3 route 198.18.0.0/15 table 100 false " + noteNotAttached,
		"eth2 4 attached; no route makes it an uplink now true ",
		"pod0 5 former uplink, draining true kept while 3 flows of 10.1.0.1, fd00::1 last",
		"wg0 9 route 100.64.0.0/10 false " + noteUnsupported,
	}
	if len(got) != len(want) {
		t.Fatalf("coverage %+v, want %d devices", got, len(want))
	}
	for i, u := range got {
		if s := fmt.Sprintf("%s %d %s %v %s", u.Device, u.Ifindex, u.Via, u.Covered, u.Note); s != want[i] {
			t.Errorf("device %d: %q, want %q", i, s, want[i])
		}
	}
}
