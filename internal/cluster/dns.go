package cluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/image"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// The cluster's DNS (ClusterOptions.DNS): CoreDNS as kubeadm deploys it, named as the
// Kubernetes e2e tests look it up (Deployment kube-system/coredns, pods labelled
// k8s-app=kube-dns, Service kube-system/kube-dns), serving the cluster's names only: there is
// no upstream to forward the rest to. Its binary is built by `make coredns` from the module in
// test/cluster/coredns (CoreDNSBinary) and runs from a one-file image of its own.

// DNSAddress is the kube-dns Service's ClusterIP, every node's kubelet's clusterDNS.
const DNSAddress = "10.96.0.10"

// ClusterDomain is the cluster's DNS domain.
const ClusterDomain = "cluster.local"

// corednsModule is the module that builds CoreDNS (its go.mod pins the version), relative to
// the repository's root.
const corednsModule = "test/cluster/coredns/go.mod"

// CoreDNSEnv names the CoreDNS binary when it is not where `make coredns` puts it.
const CoreDNSEnv = "IP_MASQ_AGENT_COREDNS"

// CoreDNSBinary finds the CoreDNS binary: $IP_MASQ_AGENT_COREDNS, or bin/coredns/VERSION/coredns
// of the repository, VERSION being github.com/coredns/coredns's in its module, where
// `make coredns` builds it. The error says how to build it.
func CoreDNSBinary() (string, error) {
	if bin := os.Getenv(CoreDNSEnv); bin != "" {
		return bin, nil
	}
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	version, err := CoreDNSVersion(root)
	if err != nil {
		return "", err
	}
	bin := filepath.Join(root, "bin", "coredns", version, "coredns")
	if _, err := os.Stat(bin); err != nil {
		return "", fmt.Errorf("no CoreDNS %s (run make coredns): %w", version, err)
	}
	return bin, nil
}

// CoreDNSVersion is the CoreDNS release the CoreDNS module builds.
func CoreDNSVersion(root string) (string, error) {
	return requiredVersion(filepath.Join(root, corednsModule), "github.com/coredns/coredns")
}

// CoreDNSRef is the reference of the CoreDNS image of a version: kubeadm's.
func CoreDNSRef(version string) string { return "registry.k8s.io/coredns/coredns:" + version }

// BuildCoreDNS packs the CoreDNS binary as a one-file OCI image archive in dir, named
// CoreDNSRef, and returns the archive.
func BuildCoreDNS(dir string) (string, error) {
	bin, err := CoreDNSBinary()
	if err != nil {
		return "", err
	}
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	version, err := CoreDNSVersion(root)
	if err != nil {
		return "", err
	}
	rootfs := filepath.Join(dir, "coredns-rootfs.tar")
	if err := oneFileTar(rootfs, bin, "coredns"); err != nil {
		return "", err
	}
	out := filepath.Join(dir, "coredns.tar")
	_, err = image.Pack(image.Options{
		Spec:    image.Spec{Suite: "none", Binary: "/coredns", User: "0:0"},
		Version: strings.TrimPrefix(version, "v"), Reference: CoreDNSRef(version),
		Epoch: time.Unix(0, 0), Output: out,
	}, rootfs)
	return out, err
}

// corednsRef is the reference of the CoreDNS image BuildCoreDNS packs.
func corednsRef() (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	version, err := CoreDNSVersion(root)
	if err != nil {
		return "", err
	}
	return CoreDNSRef(version), nil
}

// corefile is CoreDNS's configuration: the cluster's zone and the reverse zones, with kubeadm's
// plugins but forward.
const corefile = `.:53 {
    errors
    health {
        lameduck 5s
    }
    ready
    kubernetes ` + ClusterDomain + ` in-addr.arpa ip6.arpa {
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 30
    }
    cache 30
    loadbalance
    reload
}
`

const (
	dnsNamespace = metav1.NamespaceSystem
	dnsName      = "coredns"
	dnsService   = "kube-dns"
)

// dnsLabels are the CoreDNS pods' labels, which the kube-dns Service selects.
var dnsLabels = map[string]string{"k8s-app": "kube-dns"}

// startDNS deploys CoreDNS and waits until every node resolves the kubernetes Service's name
// through DNSAddress (CoreDNS answers, and each node's kube-proxy has the Service).
func (c *Cluster) startDNS(ctx context.Context) error {
	ref, err := corednsRef()
	if err != nil {
		return err
	}
	cs := c.Client
	meta := metav1.ObjectMeta{Name: dnsName, Namespace: dnsNamespace}
	create := []func() error{
		func() error {
			_, err := cs.CoreV1().ServiceAccounts(dnsNamespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: meta}, metav1.CreateOptions{})
			return err
		},
		func() error {
			_, err := cs.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{
				ObjectMeta: metav1.ObjectMeta{Name: "system:coredns"},
				Rules: []rbacv1.PolicyRule{
					{APIGroups: []string{""}, Resources: []string{"endpoints", "services", "pods", "namespaces"}, Verbs: []string{"list", "watch"}},
					{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: []string{"list", "watch"}},
				},
			}, metav1.CreateOptions{})
			return err
		},
		func() error {
			_, err := cs.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
				ObjectMeta: metav1.ObjectMeta{Name: "system:coredns"},
				RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "system:coredns"},
				Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: dnsName, Namespace: dnsNamespace}},
			}, metav1.CreateOptions{})
			return err
		},
		func() error {
			_, err := cs.CoreV1().ConfigMaps(dnsNamespace).Create(ctx, &corev1.ConfigMap{ObjectMeta: meta,
				Data: map[string]string{"Corefile": corefile}}, metav1.CreateOptions{})
			return err
		},
		func() error {
			_, err := cs.AppsV1().Deployments(dnsNamespace).Create(ctx, corednsDeployment(ref), metav1.CreateOptions{})
			return err
		},
		func() error {
			_, err := cs.CoreV1().Services(dnsNamespace).Create(ctx, &corev1.Service{
				ObjectMeta: metav1.ObjectMeta{Name: dnsService, Namespace: dnsNamespace,
					Labels: map[string]string{"k8s-app": "kube-dns", "kubernetes.io/name": "CoreDNS"}},
				Spec: corev1.ServiceSpec{
					ClusterIP: DNSAddress,
					Selector:  dnsLabels,
					Ports: []corev1.ServicePort{
						{Name: "dns", Port: 53, Protocol: corev1.ProtocolUDP, TargetPort: intstr.FromInt32(53)},
						{Name: "dns-tcp", Port: 53, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(53)},
					},
				},
			}, metav1.CreateOptions{})
			return err
		},
	}
	for _, f := range create {
		if err := f(); err != nil {
			return fmt.Errorf("deploy CoreDNS: %w", err)
		}
	}
	if err := poll(ctx, "CoreDNS ready", func() error {
		d, err := cs.AppsV1().Deployments(dnsNamespace).Get(ctx, dnsName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if d.Status.ReadyReplicas < 1 {
			return c.dnsWaiting(ctx)
		}
		return nil
	}, c.kubelets()...); err != nil {
		return err
	}
	for _, n := range c.Nodes {
		r := DNSResolver(netnsPath(n.Netns))
		name := "kubernetes.default.svc." + ClusterDomain + "."
		if err := poll(ctx, n.Name+" resolves "+name, func() error {
			ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			_, err := r.LookupHost(ctx, name)
			return err
		}, n.kubelet, n.proxy); err != nil {
			return err
		}
	}
	return nil
}

// dnsWaiting says why no CoreDNS pod is ready yet.
func (c *Cluster) dnsWaiting(ctx context.Context) error {
	pods, err := c.Client.CoreV1().Pods(dnsNamespace).List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=kube-dns"})
	if err != nil {
		return err
	}
	if len(pods.Items) == 0 {
		return errors.New("no CoreDNS pod yet")
	}
	var errs []error
	for i := range pods.Items {
		p := &pods.Items[i]
		errs = append(errs, fmt.Errorf("pod %s on %q: phase %s, %s", p.Name, p.Spec.NodeName, p.Status.Phase, describeWaiting(p)))
	}
	return errors.Join(errs...)
}

// corednsDeployment is kubeadm's CoreDNS Deployment, one replica, its image never pulled.
func corednsDeployment(ref string) *appsv1.Deployment {
	replicas := int32(1)
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: dnsName, Namespace: dnsNamespace, Labels: dnsLabels},
		Spec: appsv1.DeploymentSpec{
			Replicas: &replicas,
			Selector: &metav1.LabelSelector{MatchLabels: dnsLabels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: dnsLabels},
				Spec: corev1.PodSpec{
					ServiceAccountName: dnsName,
					DNSPolicy:          corev1.DNSDefault,
					PriorityClassName:  "system-cluster-critical",
					Containers: []corev1.Container{{
						Name: "coredns", Image: ref, ImagePullPolicy: corev1.PullNever,
						Args: []string{"-conf", "/etc/coredns/Corefile"},
						Ports: []corev1.ContainerPort{
							{Name: "dns", ContainerPort: 53, Protocol: corev1.ProtocolUDP},
							{Name: "dns-tcp", ContainerPort: 53, Protocol: corev1.ProtocolTCP},
						},
						VolumeMounts: []corev1.VolumeMount{{Name: "config-volume", MountPath: "/etc/coredns", ReadOnly: true}},
						ReadinessProbe: &corev1.Probe{
							ProbeHandler:  corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/ready", Port: intstr.FromInt32(8181)}},
							PeriodSeconds: 1,
						},
						LivenessProbe: &corev1.Probe{
							ProbeHandler:        corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/health", Port: intstr.FromInt32(8080)}},
							InitialDelaySeconds: 60, TimeoutSeconds: 5, FailureThreshold: 5,
						},
					}},
					Volumes: []corev1.Volume{{Name: "config-volume", VolumeSource: corev1.VolumeSource{
						ConfigMap: &corev1.ConfigMapVolumeSource{
							LocalObjectReference: corev1.LocalObjectReference{Name: dnsName},
							Items:                []corev1.KeyToPath{{Key: "Corefile", Path: "Corefile"}},
						},
					}}},
				},
			},
		},
	}
}

// DNSResolver is a resolver that asks the cluster's DNS (DNSAddress) from inside the network
// namespace whose file is path (a node's, a pod's: PodNetns). Give it fully qualified names
// ("kubernetes.default.svc.cluster.local."): the search list it would apply is this host's.
func DNSResolver(path string) *net.Resolver {
	return &net.Resolver{
		PreferGo: true,
		Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return Dialer(path, nil)(ctx, network, net.JoinHostPort(DNSAddress, "53"))
		},
	}
}
