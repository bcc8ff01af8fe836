package bpf

import (
	"bytes"
	"context"
	"crypto/rand"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
)

// TestOffloadedTraffic sends real traffic through the programs, attached with tcx to a veth in
// a namespace sandbox, to cover what BPF_PROG_TEST_RUN cannot build: CHECKSUM_PARTIAL and GSO
// packets (veth offloads checksums and segmentation), and IPv4 fragments made by a real stack.
//
//	pod ns P --veth-- node ns A [programs on up0] --veth-- router ns B --veth-- server ns C
//
// A "pod" in P talks to a server in C. B has no route to the pods, so only masqueraded packets
// get answers. Offloaded checksums are trusted across veth and never checked, so the hops after
// a rewrite have transmit checksumming off (A toward P, B toward C): the kernel then completes
// each checksum from what the programs left in the packet, and the receiver verifies it.
func TestOffloadedTraffic(t *testing.T) {
	testutil.RequirePrivileged(t, "ip")
	nsP, nsA, nsB, nsC := testutil.NewNetns(t), testutil.NewNetns(t), testutil.NewNetns(t), testutil.NewNetns(t)
	ip := func(args ...string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if out, err := exec.CommandContext(ctx, "ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	sysctl := func(ns string, kv map[string]string) {
		t.Helper()
		testutil.InNetns(t, ns, func() {
			for k, v := range kv {
				if err := os.WriteFile("/proc/sys/net/"+k, []byte(v), 0o644); err != nil {
					t.Fatalf("sysctl net/%s in %s: %v", k, ns, err)
				}
			}
		})
	}
	for _, ns := range []string{nsP, nsA, nsB, nsC} {
		// No duplicate address detection: devices are usable as soon as they are up.
		sysctl(ns, map[string]string{"ipv6/conf/all/accept_dad": "0", "ipv6/conf/default/accept_dad": "0"})
	}
	for _, ns := range []string{nsA, nsB} {
		sysctl(ns, map[string]string{"ipv4/ip_forward": "1", "ipv6/conf/all/forwarding": "1"})
	}
	ip("-n", nsA, "link", "add", "host0", "type", "veth", "peer", "name", "pod0", "netns", nsP)
	ip("-n", nsA, "link", "add", "up0", "type", "veth", "peer", "name", "up1", "netns", nsB)
	ip("-n", nsB, "link", "add", "b0", "type", "veth", "peer", "name", "c0", "netns", nsC)
	for _, a := range [][]string{
		{nsP, "pod0", "10.1.0.2/24", "fd00:1::2/64"},
		{nsA, "host0", "10.1.0.1/24", "fd00:1::1/64"},
		{nsA, "up0", "192.0.2.1/24", "2001:db8:a::1/64"},
		{nsB, "up1", "192.0.2.2/24", "2001:db8:a::2/64"},
		{nsB, "b0", "198.51.100.1/24", "2001:db8:c::1/64"},
		{nsC, "c0", "198.51.100.2/24", "2001:db8:c::2/64"},
	} {
		ip("-n", a[0], "addr", "add", a[2], "dev", a[1])
		ip("-n", a[0], "addr", "add", a[3], "dev", a[1])
		ip("-n", a[0], "link", "set", a[1], "up")
	}
	for _, ns := range []string{nsP, nsA, nsB, nsC} {
		ip("-n", ns, "link", "set", "lo", "up")
	}
	ip("-n", nsP, "route", "add", "default", "via", "10.1.0.1")
	ip("-n", nsP, "-6", "route", "add", "default", "via", "fd00:1::1")
	ip("-n", nsA, "route", "add", "default", "via", "192.0.2.2")
	ip("-n", nsA, "-6", "route", "add", "default", "via", "2001:db8:a::2")
	ip("-n", nsC, "route", "add", "default", "via", "198.51.100.1")
	ip("-n", nsC, "-6", "route", "add", "default", "via", "2001:db8:c::1")
	testutil.InNetns(t, nsA, func() { setTxChecksum(t, "host0", false) })
	testutil.InNetns(t, nsB, func() { setTxChecksum(t, "b0", false) })

	realTraffic(t)
	h := newHarness(t, defaultPolicy(true), LoadOptions{})
	var up0 *net.Interface
	testutil.InNetns(t, nsA, func() {
		var err error
		if up0, err = net.InterfaceByName("up0"); err != nil {
			t.Fatal(err)
		}
		// The kernel's own attach mode, as the agent's: tcx links, else clsact and cls_bpf.
		mode, _, err := tc.Probe()
		if err != nil {
			t.Fatal(err)
		}
		m, err := tc.NewManager(mode, tc.Options{LinkDir: testutil.MountBPFFS(t), FilterName: "offload-test", FilterPriority: 1, FilterHandle: 1})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		if err := m.Attach(context.Background(), up0.Index, tc.Programs{Egress: h.dp.Egress(), Ingress: h.dp.Ingress()}); err != nil {
			t.Fatalf("attach to up0 (%s): %v", mode, err)
		}
	})
	if _, err := h.dp.SetUplink(up0.Index, Uplink{IPv4: netip.MustParseAddr("192.0.2.1"), IPv6: netip.MustParseAddr("2001:db8:a::1")}); err != nil {
		t.Fatal(err)
	}

	for _, c := range []struct {
		name        string
		server, nat string
		udpSizes    []int
	}{
		// 3000-byte datagrams leave and return as fragments.
		{"ipv4", "198.51.100.2", "192.0.2.1", []int{100, 1400, 3000}},
		{"ipv6", "2001:db8:c::2", "2001:db8:a::1", []int{100, 1200, 3000}},
	} {
		t.Run(c.name+"/tcp", func(t *testing.T) {
			var ln net.Listener
			testutil.InNetns(t, nsC, func() {
				var err error
				if ln, err = net.Listen("tcp", net.JoinHostPort(c.server, "5001")); err != nil {
					t.Fatal(err)
				}
			})
			defer ln.Close()
			peer := make(chan string, 1)
			go func() {
				conn, err := ln.Accept()
				if err != nil {
					peer <- err.Error()
					return
				}
				defer conn.Close()
				peer <- conn.RemoteAddr().(*net.TCPAddr).IP.String()
				conn.SetDeadline(time.Now().Add(30 * time.Second))
				io.Copy(conn, conn) // echo
			}()
			var conn net.Conn
			testutil.InNetns(t, nsP, func() {
				var err error
				d := net.Dialer{Timeout: 10 * time.Second}
				if conn, err = d.Dial("tcp", net.JoinHostPort(c.server, "5001")); err != nil {
					t.Fatal(err)
				}
			})
			defer conn.Close()
			conn.SetDeadline(time.Now().Add(30 * time.Second))
			data := make([]byte, 8<<20) // large writes: GSO super-packets on every hop
			rand.Read(data)
			go conn.Write(data)
			got := make([]byte, len(data))
			if _, err := io.ReadFull(conn, got); err != nil {
				t.Fatalf("echo of %d bytes: %v", len(data), err)
			}
			if !bytes.Equal(got, data) {
				t.Fatal("echoed data differs")
			}
			if p := <-peer; p != c.nat {
				t.Fatalf("server saw the client as %s, want the uplink address %s", p, c.nat)
			}
		})
		t.Run(c.name+"/udp", func(t *testing.T) {
			var srv net.PacketConn
			testutil.InNetns(t, nsC, func() {
				var err error
				if srv, err = net.ListenPacket("udp", net.JoinHostPort(c.server, "5353")); err != nil {
					t.Fatal(err)
				}
			})
			defer srv.Close()
			peers := make(chan string, len(c.udpSizes))
			go func() {
				buf := make([]byte, 65536)
				for {
					n, from, err := srv.ReadFrom(buf)
					if err != nil {
						return
					}
					peers <- from.(*net.UDPAddr).IP.String()
					srv.WriteTo(buf[:n], from)
				}
			}()
			var conn net.Conn
			testutil.InNetns(t, nsP, func() {
				var err error
				if conn, err = net.Dial("udp", net.JoinHostPort(c.server, "5353")); err != nil {
					t.Fatal(err)
				}
			})
			defer conn.Close()
			for _, size := range c.udpSizes {
				msg := make([]byte, size)
				rand.Read(msg)
				got := make([]byte, 65536)
				var n int
				var err error
				// UDP may lose the first datagram while neighbours resolve: retry a little.
				for try := 0; try < 5; try++ {
					conn.Write(msg)
					conn.SetReadDeadline(time.Now().Add(time.Second))
					if n, err = conn.Read(got); err == nil {
						break
					}
				}
				if err != nil {
					t.Fatalf("%d-byte datagram: no answer: %v", size, err)
				}
				if !bytes.Equal(got[:n], msg) {
					t.Fatalf("%d-byte datagram: answer differs (%d bytes)", size, n)
				}
				if p := <-peers; p != c.nat {
					t.Fatalf("server saw the client as %s, want %s", p, c.nat)
				}
			}
		})
	}
	ev := h.events()
	for _, e := range Events() {
		if isDrop(e) && ev[e] != 0 {
			t.Errorf("%s: %d drops", e, ev[e])
		}
	}
}

// setTxChecksum switches a device's transmit checksum offload (ethtool -K dev tx on|off),
// through the ethtool ioctl, in the calling thread's namespace.
func setTxChecksum(t *testing.T, dev string, on bool) {
	t.Helper()
	const ethtoolSTXCSUM = 0x17
	// Heap objects, which do not move while the kernel reads them.
	val := &struct{ cmd, data uint32 }{cmd: ethtoolSTXCSUM}
	if on {
		val.data = 1
	}
	ifr := new(struct {
		name [unix.IFNAMSIZ]byte
		data uintptr
		_    [16]byte
	})
	copy(ifr.name[:], dev)
	ifr.data = uintptr(unsafe.Pointer(val))
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCETHTOOL, uintptr(unsafe.Pointer(ifr))); errno != 0 {
		t.Fatalf("ethtool -K %s tx %v: %v", dev, on, errno)
	}
	runtime.KeepAlive(val)
}
