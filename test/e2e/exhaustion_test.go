package e2e

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// TestPortExhaustion: with --to-ports holding 8 ports, 8 TCP connections from the pod to one
// remote endpoint each get one of them; further connections are refused (their SYNs dropped)
// and counted, the agent stays healthy and ready, and the 8 keep working. Once half of them
// end and their mappings expire (about a second: Backend.FastExpiry), new connections get the
// freed ports. The external host has no route back to the pod, so every answer proves a
// translation.
func TestPortExhaustion(t *testing.T) {
	const ports, extra, ended = 8, 3, 4
	portRange := policy.PortRange{First: 40000, Last: 40000 + ports - 1}
	eachBackend(t, backends(), []string{"--to-ports=" + portRange.String()}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		b.FastExpiry(ctx, t, env)
		ag := env.StartReadyNoFile(ctx, t, b)
		StartLineEcho(t, env.Ext, []netip.Addr{public4})
		env.CutReturnRoutes(ctx, t)

		exchange := func(c *Conn, line string) netip.AddrPort {
			t.Helper()
			src, err := c.Exchange(line)
			if err != nil {
				t.Fatal(err)
			}
			if src.Addr() != NodeAddr4 || src.Port() < portRange.First || src.Port() > portRange.Last {
				t.Fatalf("seen from %s, want %s and a port of %s", src, NodeAddr4, portRange)
			}
			return src
		}
		var conns []*Conn
		var seen []netip.AddrPort
		owner := map[uint16]int{}
		for i := range ports {
			c, err := DialLine(ctx, env.Pod, netip.AddrPort{}, public4)
			if err != nil {
				t.Fatalf("connection %d of %d: %v", i+1, ports, err)
			}
			defer c.Close()
			src := exchange(c, "hello")
			if j, taken := owner[src.Port()]; taken {
				t.Fatalf("connections %d and %d share port %d", j+1, i+1, src.Port())
			}
			owner[src.Port()] = i
			conns, seen = append(conns, c), append(seen, src)
		}

		// Every port is taken: further connections are refused, and counted.
		refused := b.Refusals(ctx, t, env)
		var wg sync.WaitGroup
		answered := make(chan netip.AddrPort, extra)
		for range extra {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c, err := DialLine(ctx, env.Pod, netip.AddrPort{}, public4)
				if err != nil {
					// Refused means dropped: no SYN got through within the dial's 2 s.
					if ne := net.Error(nil); !errors.As(err, &ne) || !ne.Timeout() {
						t.Errorf("a connection beyond the ports failed otherwise than by a timeout: %v", err)
					}
					return
				}
				defer c.Close()
				answered <- c.Local()
			}()
		}
		wg.Wait()
		close(answered)
		for local := range answered {
			t.Errorf("connection from %s was answered although every port is taken", local)
		}
		n := b.Refusals(ctx, t, env) - refused
		t.Logf("%d connections beyond the %d ports: %v refusals counted (SYN retransmissions included)", extra, ports, n)
		if n < extra {
			t.Errorf("%v refusals counted for %d refused connections", n, extra)
		}

		// The agent and the flows that have ports are unaffected.
		if exited, err := ag.Exited(); exited {
			t.Fatalf("the agent exited: %v", err)
		}
		for _, path := range []string{"/healthz", "/readyz"} {
			if code, body, err := ag.Get(ctx, path); err != nil || code != http.StatusOK {
				t.Errorf("%s = %d %q %v", path, code, body, err)
			}
		}
		for i, c := range conns {
			if src := exchange(c, "still-there"); src != seen[i] {
				t.Errorf("connection %d moved from %s to %s", i+1, seen[i], src)
			}
		}

		// Half the flows end; new ones get their ports once the mappings expire.
		freed := map[uint16]bool{}
		for i, c := range conns[:ended] {
			if err := c.Close(); err != nil {
				t.Fatal(err)
			}
			freed[seen[i].Port()] = true
		}
		endedAt := time.Now()
		var fresh []*Conn
		want := len(freed)
		for len(fresh) < want {
			c, err := DialLine(ctx, env.Pod, netip.AddrPort{}, public4)
			if err != nil {
				if time.Since(endedAt) > 20*time.Second {
					t.Fatalf("%d of %d new connections after %v: %v", len(fresh), want, time.Since(endedAt), err)
				}
				continue
			}
			defer c.Close()
			src := exchange(c, "fresh")
			if !freed[src.Port()] {
				t.Errorf("a new connection got port %d, which no ended flow freed (%v)", src.Port(), freed)
			}
			delete(freed, src.Port())
			fresh = append(fresh, c)
			if len(fresh) == 1 {
				t.Logf("the first new connection got a port %v after the old ones ended", time.Since(endedAt).Round(time.Millisecond))
			}
		}
		if len(freed) != 0 {
			t.Errorf("freed ports never handed out again: %v", freed)
		}
		if b.NAT {
			m, err := ag.Scrape(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if swept, _ := m.Value("ip_masq_agent_nat_swept_entries_total", Labels{"protocol": "tcp"}); swept < 2*ended {
				t.Errorf("%v TCP entries swept, want at least the %d of the ended flows", swept, 2*ended)
			}
		}
		for i, c := range conns[ended:] {
			if src := exchange(c, "after"); src != seen[ended+i] {
				t.Errorf("connection %d moved from %s to %s", ended+i+1, seen[ended+i], src)
			}
		}
	})
}
