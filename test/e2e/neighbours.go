package e2e

import (
	"context"
	"errors"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
)

// Neighbours: programs of other components on the uplink's hooks, as a CNI or a monitoring
// agent would put there. Each counts the IPv4 UDP packets to or from EchoPort that reach it
// (the probes of Datagram and their replies) and returns a fixed verdict.

// Verdicts of a neighbour.
const (
	// VerdictNext lets the chain go on (TC_ACT_UNSPEC, TCX_NEXT).
	VerdictNext int32 = -1
	// VerdictPass ends the chain and passes the packet (TC_ACT_OK, TCX_PASS).
	VerdictPass int32 = 0
)

// Neighbour is a counting program attached to a hook of a device in the node.
type Neighbour struct {
	Name    string
	counter *ebpf.Map
	prog    *ebpf.Program
	detach  func() error
}

// Where a neighbour goes.
type Placement struct {
	Dir tc.Direction
	// TCX: a tcx link at the head (Head) or the tail of the chain; else a tc filter at Priority.
	TCX      bool
	Head     bool
	Priority uint16
}

func (p Placement) String() string {
	if p.TCX {
		pos := "tail"
		if p.Head {
			pos = "head"
		}
		return fmt.Sprintf("tcx-%s-%s", p.Dir, pos)
	}
	return fmt.Sprintf("tc-%s-prio%d", p.Dir, p.Priority)
}

// newNeighbourProgram builds the counting program: IPv4 (no options) UDP with EchoPort as
// either port counts one in counter[0]; every packet gets verdict.
func newNeighbourProgram(name string, verdict int32) (*ebpf.Program, *ebpf.Map, error) {
	m, err := ebpf.NewMap(&ebpf.MapSpec{Name: "nb_count", Type: ebpf.Array, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		return nil, nil, err
	}
	port := int32(EchoPort>>8 | (EchoPort&0xff)<<8) // network byte order, as a 16-bit load sees it
	const (
		skbData    = 76 // offsetof(struct __sk_buff, data)
		skbDataEnd = 80
	)
	insns := asm.Instructions{
		asm.LoadMem(asm.R2, asm.R1, skbData, asm.Word),
		asm.LoadMem(asm.R3, asm.R1, skbDataEnd, asm.Word),
		asm.Mov.Reg(asm.R4, asm.R2),
		asm.Add.Imm(asm.R4, 14+20+8),
		asm.JGT.Reg(asm.R4, asm.R3, "out"),
		asm.LoadMem(asm.R5, asm.R2, 12, asm.Half),
		asm.JNE.Imm(asm.R5, 0x0008, "out"), // ETH_P_IP, big endian
		asm.LoadMem(asm.R5, asm.R2, 14, asm.Byte),
		asm.JNE.Imm(asm.R5, 0x45, "out"),
		asm.LoadMem(asm.R5, asm.R2, 14+9, asm.Byte),
		asm.JNE.Imm(asm.R5, unix.IPPROTO_UDP, "out"),
		asm.LoadMem(asm.R5, asm.R2, 14+20, asm.Half),
		asm.JEq.Imm(asm.R5, port, "count"),
		asm.LoadMem(asm.R5, asm.R2, 14+22, asm.Half),
		asm.JNE.Imm(asm.R5, port, "out"),
		asm.Mov.Imm(asm.R1, 0).WithSymbol("count"),
		asm.StoreMem(asm.RFP, -4, asm.R1, asm.Word),
		asm.LoadMapPtr(asm.R1, m.FD()),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, -4),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "out"),
		asm.Mov.Imm(asm.R1, 1),
		asm.StoreXAdd(asm.R0, asm.R1, asm.DWord),
		asm.Mov.Imm(asm.R0, verdict).WithSymbol("out"),
		asm.Return(),
	}
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: name, Type: ebpf.SchedCLS, License: "GPL", Instructions: insns})
	if err != nil {
		m.Close()
		return nil, nil, fmt.Errorf("load neighbour program: %+v", err)
	}
	return p, m, nil
}

// AttachNeighbour attaches a counting program with verdict to the node's uplink, and detaches it
// when the test ends (unless Detach did already).
func (e *Env) AttachNeighbour(t testing.TB, name string, at Placement, verdict int32) *Neighbour {
	t.Helper()
	if at.TCX {
		has, err := tc.HaveTCX()
		if err != nil {
			t.Fatal(err)
		}
		if !has {
			testutil.NotOnThisKernel(t, "a tcx neighbour needs tcx links")
		}
	}
	prog, counter, err := newNeighbourProgram(name, verdict)
	if err != nil {
		t.Fatal(err)
	}
	n := &Neighbour{Name: name, counter: counter, prog: prog}
	err = testutil.Do(e.Node, func() error {
		ifc, err := net.InterfaceByName(Uplink)
		if err != nil {
			return err
		}
		if at.TCX {
			typ, anchor := ebpf.AttachTCXEgress, link.Tail()
			if at.Dir == tc.Ingress {
				typ = ebpf.AttachTCXIngress
			}
			if at.Head {
				anchor = link.Head()
			}
			l, err := link.AttachTCX(link.TCXOptions{Interface: ifc.Index, Program: prog, Attach: typ, Anchor: anchor})
			if err != nil {
				return err
			}
			n.detach = l.Close
			return nil
		}
		q := &netlink.GenericQdisc{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: ifc.Index, Handle: netlink.MakeHandle(0xffff, 0),
			Parent: netlink.HANDLE_CLSACT}, QdiscType: "clsact"}
		if err := netlink.QdiscAdd(q); err != nil && !errors.Is(err, unix.EEXIST) {
			return err
		}
		parent := uint32(netlink.HANDLE_MIN_EGRESS)
		if at.Dir == tc.Ingress {
			parent = netlink.HANDLE_MIN_INGRESS
		}
		f := &netlink.BpfFilter{FilterAttrs: netlink.FilterAttrs{LinkIndex: ifc.Index, Parent: parent, Handle: 7,
			Priority: at.Priority, Protocol: unix.ETH_P_ALL}, Fd: prog.FD(), Name: name, DirectAction: true}
		if err := netlink.FilterAdd(f); err != nil {
			return err
		}
		n.detach = func() error { return testutil.Do(e.Node, func() error { return netlink.FilterDel(f) }) }
		return nil
	})
	if err != nil {
		prog.Close()
		counter.Close()
		t.Fatalf("attach neighbour %s at %s: %v", name, at, err)
	}
	t.Cleanup(func() {
		n.Detach(t)
		prog.Close()
		counter.Close()
	})
	return n
}

// Count is how many probe packets the neighbour has seen.
func (n *Neighbour) Count(t testing.TB) uint64 {
	t.Helper()
	var v uint64
	if err := n.counter.Lookup(uint32(0), &v); err != nil {
		t.Fatal(err)
	}
	return v
}

// Detach removes the neighbour; again is fine.
func (n *Neighbour) Detach(t testing.TB) {
	t.Helper()
	if n.detach == nil {
		return
	}
	if err := n.detach(); err != nil && !errors.Is(err, unix.ENOENT) {
		t.Errorf("detach neighbour %s: %v", n.Name, err)
	}
	n.detach = nil
}

// Attached tells whether the neighbour is still on the uplink.
func (n *Neighbour) Attached(t testing.TB, e *Env) bool {
	t.Helper()
	progs, _ := e.UplinkPrograms(t)
	for _, p := range progs {
		if p.Name == n.Name {
			return true
		}
	}
	return false
}

// Background sends a datagram from the pod to dst's echo server every interval until the test
// (or stop) ends, ignoring the answers: traffic for the drift checks to sample.
func (tp *Topology) Background(t testing.TB, dst string, interval time.Duration) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(interval)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			_ = testutil.Do(tp.Pod, func() error {
				c, err := net.Dial("udp", net.JoinHostPort(dst, fmt.Sprint(EchoPort)))
				if err != nil {
					return err
				}
				defer c.Close()
				_, err = c.Write([]byte("background\n"))
				return err
			})
		}
	}()
	stop = func() {
		cancel()
		<-done
	}
	t.Cleanup(stop)
	return stop
}
