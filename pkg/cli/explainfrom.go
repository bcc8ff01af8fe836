package cli

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/kubernetes"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// explainSource is explain's --from: the source whose traffic is explained, and the source rule
// that decides it.
type explainSource struct {
	// name is what --from said; addrs the source's addresses (a pod's, one per family).
	name  string
	addrs []netip.Addr
	// rule decides the source's traffic, nil for the global lists; why says what made it hold
	// the source.
	rule *policy.SourceRule
	why  string
}

// fromTimeout bounds explain's reads of a pod and its namespace.
const fromTimeout = 10 * time.Second

// resolveSource finds the source rule of --from: an address is held as the datapath holds it
// (a rule's CIDRs, or the pod addresses the running agent's selectors chose); a pod,
// NAMESPACE/NAME, is read from the API server and held by its addresses or its labels.
func resolveSource(ctx context.Context, from, kubeconfig string, p *policy.Policy) (*explainSource, error) {
	if a, err := netip.ParseAddr(from); err == nil {
		src := &explainSource{name: from, addrs: []netip.Addr{a.Unmap()}}
		if src.rule = p.SourceRuleOf(a); src.rule != nil {
			src.why = src.rule.Why(a)
		}
		return src, nil
	}
	ns, name, ok := strings.Cut(from, "/")
	if !ok || ns == "" || name == "" || strings.Contains(name, "/") {
		return nil, usageError{fmt.Errorf("--from %q: want an IP address or NAMESPACE/POD", from)}
	}
	cfg, err := kube.Config(kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("--from %s: %w", from, err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("--from %s: %w", from, err)
	}
	ctx, cancel := context.WithTimeout(ctx, fromTimeout)
	defer cancel()
	// Listed by name rather than read: the agent's own grant (deploy/rbac/pods), which explain
	// has in the agent's pod, is to list and watch.
	pods, err := client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + name})
	if err != nil {
		return nil, fmt.Errorf("--from %s: read the pod: %w", from, err)
	}
	if len(pods.Items) == 0 {
		return nil, fmt.Errorf("--from %s: no such pod", from)
	}
	pod := &pods.Items[0]
	nss, err := client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + ns})
	if err != nil {
		return nil, fmt.Errorf("--from %s: read its namespace: %w", from, err)
	}
	if len(nss.Items) == 0 {
		return nil, fmt.Errorf("--from %s: no namespace %s", from, ns)
	}
	namespace := &nss.Items[0]
	src := &explainSource{name: from}
	for _, ip := range pod.Status.PodIPs {
		if a, err := netip.ParseAddr(ip.IP); err == nil {
			src.addrs = append(src.addrs, a.Unmap())
		}
	}
	if pod.Spec.HostNetwork {
		return nil, fmt.Errorf("--from %s: the pod uses the node's network: its traffic is the node's own, which is never masqueraded", from)
	}
	if len(src.addrs) == 0 {
		return nil, fmt.Errorf("--from %s: the pod has no address yet", from)
	}
	for i := range p.Sources {
		s := &p.Sources[i]
		for _, a := range src.addrs {
			if why := s.Why(a); why != "" && why != "selects the pod" {
				src.rule, src.why = s, why
			}
		}
		if src.rule == nil && s.SelectsPod(labels.Set(namespace.Labels), labels.Set(pod.Labels)) {
			src.rule, src.why = s, selectorWhy(s)
		}
		if src.rule != nil {
			break
		}
	}
	return src, nil
}

// selectorWhy says which selectors of a rule chose a pod.
func selectorWhy(s *policy.SourceRule) string {
	var parts []string
	if sel := s.Config.NamespaceSelector; sel != nil {
		parts = append(parts, "namespaceSelector "+metav1.FormatLabelSelector(sel))
	}
	if sel := s.Config.PodSelector; sel != nil {
		parts = append(parts, "podSelector "+metav1.FormatLabelSelector(sel))
	}
	return strings.Join(parts, ", ")
}

// describe is explain's line about the source.
func (s *explainSource) describe() string {
	name := s.name
	if s.addrs[0].String() != s.name {
		name += " (" + joinAddrs(s.addrs) + ")"
	}
	if s.rule == nil {
		return fmt.Sprintf("from %s: no source rule holds it: the global keys decide", name)
	}
	return fmt.Sprintf("from %s: source rule %s (sourceRules[%d]: %s) decides by its keys over the global ones",
		name, s.rule.Name, s.rule.Index, s.why)
}

func joinAddrs(as []netip.Addr) string {
	out := make([]string, len(as))
	for i, a := range as {
		out[i] = a.String()
	}
	return strings.Join(out, ", ")
}

// decide is the verdict for traffic from the source to dst.
func (s *explainSource) decide(p *policy.Policy, dst netip.Addr) policy.Verdict {
	if s == nil || s.rule == nil || !p.Enabled(policy.FamilyOf(dst.Unmap())) {
		return p.Decide(dst)
	}
	return s.rule.Decide(dst)
}
