package tc

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"slices"
	"testing"

	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// neighbourNames lists neighbours as "direction position name".
func neighbourNames(ns []Neighbour) []string {
	var out []string
	for _, n := range ns {
		pos := "behind"
		if n.Ahead {
			pos = "ahead"
		}
		out = append(out, fmt.Sprintf("%s %s %s", n.Dir, pos, n.Name))
	}
	return out
}

func attachForeignTCX(t *testing.T, ifindex int, d Direction, name string, anchor link.Anchor) {
	t.Helper()
	l, err := link.AttachTCX(link.TCXOptions{Interface: ifindex, Program: newProg(t, name, 5), Attach: attachType(d), Anchor: anchor})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
}

func addForeignFilter(t *testing.T, ifindex int, d Direction, name string, prio uint16) {
	t.Helper()
	q := &netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: ifindex, Handle: netlink.MakeHandle(0xffff, 0),
		Parent: netlink.HANDLE_CLSACT}, QdiscType: "clsact"}
	if err := netlink.QdiscAdd(q); err != nil && !errors.Is(err, unix.EEXIST) {
		t.Fatal(err)
	}
	p := newProg(t, name, 6)
	f := &netlink.BpfFilter{FilterAttrs: netlink.FilterAttrs{LinkIndex: ifindex, Parent: parent(d), Handle: 1,
		Priority: prio, Protocol: unix.ETH_P_ALL}, Fd: p.FD(), Name: name, DirectAction: true}
	if err := netlink.FilterAdd(f); err != nil {
		t.Fatal(err)
	}
}

// TestTCXNeighbours: a new link of ours goes at the head of egress and the tail of ingress;
// Neighbours tells the programs of others ahead of ours from those behind, and puts every tc
// filter behind a tcx program of ours.
func TestTCXNeighbours(t *testing.T) {
	sb := newSandbox(t)
	requireTCX(t)
	ctx := context.Background()
	testutil.InNetns(t, sb.ns, func() {
		// There first: behind ours on egress, ahead on ingress.
		attachForeignTCX(t, sb.a, Egress, "early_eg", nil)
		attachForeignTCX(t, sb.a, Ingress, "early_in", nil)
		m, err := NewManager(ModeTCX, sb.opts)
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		ns, err := m.Neighbours(ctx, sb.a)
		if err != nil {
			t.Fatal(err)
		}
		// Not attached yet: ahead of nothing.
		if got, want := neighbourNames(ns), []string{"egress behind early_eg", "ingress behind early_in"}; !slices.Equal(got, want) {
			t.Fatalf("before ours: %q, want %q", got, want)
		}
		if err := m.Attach(ctx, sb.a, sb.progs); err != nil {
			t.Fatal(err)
		}
		// Later: one put at the head of egress (ahead), one appended to ingress (behind); a tc
		// filter, which runs after every tcx program.
		attachForeignTCX(t, sb.a, Egress, "late_eg", link.Head())
		attachForeignTCX(t, sb.a, Ingress, "late_in", nil)
		addForeignFilter(t, sb.a, Egress, "cls", 1)
		if ns, err = m.Neighbours(ctx, sb.a); err != nil {
			t.Fatal(err)
		}
		want := []string{"egress ahead late_eg", "egress behind early_eg", "egress behind cls",
			"ingress ahead early_in", "ingress behind late_in"}
		if got := neighbourNames(ns); !slices.Equal(got, want) {
			t.Fatalf("neighbours %q, want %q", got, want)
		}
		for _, n := range ns {
			if n.Program == 0 || (n.Mode == ModeTC) != (n.Priority == 1) {
				t.Errorf("neighbour %+v: no program id, or a priority that is not its own", n)
			}
		}
		if _, err := m.Neighbours(ctx, 4242); !errors.Is(err, ErrNoDevice) {
			t.Errorf("neighbours of no device: %v, want ErrNoDevice", err)
		}
	})
}

// TestClsactNeighbours: in tc mode every tcx program and every filter of a lower priority run
// ahead of our filter; filters of a higher priority behind.
func TestClsactNeighbours(t *testing.T) {
	sb := newSandbox(t)
	ctx := context.Background()
	testutil.InNetns(t, sb.ns, func() {
		m, err := NewManager(ModeTC, sb.opts)
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		if err := m.Attach(ctx, sb.a, sb.progs); err != nil {
			t.Fatal(err)
		}
		addForeignFilter(t, sb.a, Egress, "low", 1)
		addForeignFilter(t, sb.a, Egress, "high", 30000)
		addForeignFilter(t, sb.a, Ingress, "auto", 49152)
		want := []string{"egress ahead low", "egress behind high", "ingress behind auto"}
		if mode, _, _ := Probe(); mode == ModeTCX {
			attachForeignTCX(t, sb.a, Ingress, "x_in", nil)
			want = []string{"egress ahead low", "egress behind high", "ingress ahead x_in", "ingress behind auto"}
		}
		ns, err := m.Neighbours(ctx, sb.a)
		if err != nil {
			t.Fatal(err)
		}
		if got := neighbourNames(ns); !slices.Equal(got, want) {
			t.Fatalf("neighbours %q, want %q", got, want)
		}
	})
}

// TestDevicePackets: the counters move with the traffic the device sends and receives.
func TestDevicePackets(t *testing.T) {
	sb := newSandbox(t)
	ctx := context.Background()
	for _, args := range [][]string{{"link", "set", "va", "up"}, {"link", "set", "vb", "up"}} {
		if out, err := exec.Command("ip", append([]string{"-n", sb.ns}, args...)...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	testutil.InNetns(t, sb.ns, func() {
		m, err := NewManager(ModeTC, sb.opts)
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		_, out0, err := m.DevicePackets(ctx, sb.a)
		if err != nil {
			t.Fatal(err)
		}
		// Three frames sent on va, which vb receives: an AF_PACKET socket goes through the
		// qdisc and the device at once, with no neighbour resolution to wait for.
		fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(fd)
		frame := append(make([]byte, 12), 0x88, 0xb5) // local experimental ethertype
		frame = append(frame, make([]byte, 46)...)
		for i := range 6 {
			frame[i] = 0xff
		}
		for range 3 {
			if err := unix.Sendto(fd, frame, 0, &unix.SockaddrLinklayer{Ifindex: sb.a}); err != nil {
				t.Fatal(err)
			}
		}
		_, out1, err := m.DevicePackets(ctx, sb.a)
		if err != nil {
			t.Fatal(err)
		}
		in1, _, err := m.DevicePackets(ctx, sb.b)
		if err != nil {
			t.Fatal(err)
		}
		if out1-out0 < 3 || in1 < 3 {
			t.Errorf("va sent %d packets, vb received %d; want at least 3 each", out1-out0, in1)
		}
		if _, _, err := m.DevicePackets(ctx, 4242); !errors.Is(err, ErrNoDevice) {
			t.Errorf("counters of no device: %v, want ErrNoDevice", err)
		}
	})
}
