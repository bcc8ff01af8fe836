package cluster

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// Services of every type, backed by a pod on the node, reached from outside: the node's other
// tenant, kube-proxy, DNATs each to the pod, and the agent must leave the replies alone
// (they leave the uplink from the Service's address, which the node may not own).

// Addresses the outside routes to the node for the Services that have them: a LoadBalancer's
// ingress (set by hand: no cloud provider) and an external IP. The node owns neither.
var (
	lbAddress       = netip.MustParseAddr("198.51.100.10")
	externalAddress = netip.MustParseAddr("198.51.100.20")
)

// BackendPort is where the Services' backend pod listens; ServicePort is the Services' port.
const (
	BackendPort = 8080
	ServicePort = 80
)

// service is one way into the backend from outside.
type service struct {
	name string
	// addr is what the outside client connects to, read from the Service once it exists.
	addr func(svc *corev1.Service) netip.AddrPort
}

var services = []service{
	{name: "clusterip", addr: func(s *corev1.Service) netip.AddrPort {
		return netip.AddrPortFrom(netip.MustParseAddr(s.Spec.ClusterIP), ServicePort)
	}},
	{name: "nodeport", addr: func(s *corev1.Service) netip.AddrPort {
		return netip.AddrPortFrom(cluster.NodeAddress, uint16(s.Spec.Ports[0].NodePort))
	}},
	{name: "loadbalancer", addr: func(*corev1.Service) netip.AddrPort { return netip.AddrPortFrom(lbAddress, ServicePort) }},
	{name: "externalip", addr: func(*corev1.Service) netip.AddrPort { return netip.AddrPortFrom(externalAddress, ServicePort) }},
}

// serviceWorld is the backend pod and its Services, made once per cluster (kube-proxy programs
// them whatever the agent does).
type serviceWorld struct {
	svcs    map[string]*corev1.Service
	clients []client
}

// setUpServices runs the backend pod (whoami on BackendPort in its namespace), makes one
// Service of each kind for TCP and UDP, routes their outside addresses to the node, and
// returns the outside clients: one at an address the policy keeps, one at an address it would
// masquerade.
func (w *world) setUpServices(ctx context.Context, t *testing.T) *serviceWorld {
	t.Helper()
	c := w.c
	if _, err := c.Client.CoreV1().Pods("default").Create(ctx, cluster.PausePod("web", map[string]string{"app": "web"}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod, err := c.WaitPodRunning(ctx, "default", "web")
	if err != nil {
		t.Fatal(err)
	}
	path, err := c.PodNetns(pod.UID)
	if err != nil {
		t.Fatal(err)
	}
	serveWhoami(t, path, BackendPort)
	for _, a := range []netip.Addr{lbAddress, externalAddress} {
		if _, err := (cluster.Namespaces{}).Run(ctx, 10*time.Second, "ip", "-n", c.Outside, "route", "add", a.String()+"/32", "via", cluster.NodeAddress.String()); err != nil {
			t.Fatal(err)
		}
	}
	sw := &serviceWorld{svcs: map[string]*corev1.Service{}, clients: []client{
		{name: "outside-kept", nsPath: "/run/netns/" + c.Outside, src: outsideKept},
		{name: "outside-masqueraded", nsPath: "/run/netns/" + c.Outside, src: outsideClient},
	}}
	for _, s := range services {
		sw.svcs[s.name] = createService(ctx, t, c, s.name)
	}
	return sw
}

// createService makes the Service of a kind, TCP and UDP on ServicePort to BackendPort of the
// web pod; a LoadBalancer gets its ingress address written into its status, as a cloud's
// controller would.
func createService(ctx context.Context, t *testing.T, c *cluster.Cluster, kind string) *corev1.Service {
	t.Helper()
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web-" + kind},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": "web"},
			Ports: []corev1.ServicePort{
				{Name: "tcp", Protocol: corev1.ProtocolTCP, Port: ServicePort, TargetPort: intstr.FromInt32(BackendPort)},
				{Name: "udp", Protocol: corev1.ProtocolUDP, Port: ServicePort, TargetPort: intstr.FromInt32(BackendPort)},
			},
		},
	}
	switch kind {
	case "nodeport":
		svc.Spec.Type = corev1.ServiceTypeNodePort
	case "loadbalancer":
		svc.Spec.Type = corev1.ServiceTypeLoadBalancer
	case "externalip":
		svc.Spec.ExternalIPs = []string{externalAddress.String()}
	}
	svc, err := c.Client.CoreV1().Services("default").Create(ctx, svc, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if kind == "loadbalancer" {
		svc.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: lbAddress.String()}}
		if svc, err = c.Client.CoreV1().Services("default").UpdateStatus(ctx, svc, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// NodePort services use the TCP port's node port for both protocols here; a UDP node port
	// is its own.
	return svc
}

// checkServices reaches every Service from each outside client over TCP and UDP. Each must
// answer, from the address the client asked (the reply un-DNATed, not masqueraded by the
// agent); what source the backend saw is kube-proxy's choice (it masquerades off-cluster
// traffic), reported, not asserted.
func (w *world) checkServices(ctx context.Context, t *testing.T, sw *serviceWorld, b backend) {
	t.Helper()
	for _, s := range services {
		svc := sw.svcs[s.name]
		for _, cl := range sw.clients {
			for i, proto := range []string{"tcp", "udp"} {
				dst := s.addr(svc)
				if s.name == "nodeport" {
					dst = netip.AddrPortFrom(cluster.NodeAddress, uint16(svc.Spec.Ports[i].NodePort))
				}
				t.Run(fmt.Sprintf("%s/%s/%s", s.name, cl.name, proto), func(t *testing.T) {
					got, err := cl.whoami(ctx, proto, dst)
					if err != nil {
						t.Fatalf("%s from %s to %s: %v", proto, cl.src, dst, err)
					}
					t.Logf("%s %s -> %s: the backend saw %s", proto, cl.src, dst, got)
				})
			}
		}
	}
}
