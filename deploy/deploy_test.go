// Package deploy holds the Kubernetes manifests; its test decodes each of them strictly into the
// API types and checks the invariants the agent relies on.
package deploy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/ip-masq-agent/ip-masq-agent/internal/image"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/metrics"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Local types for the two non-core kinds, with only the fields this project writes: strict
// decoding then still rejects any misspelt or misplaced field.
type kustomization struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Namespace  string   `json:"namespace,omitempty"`
	Resources  []string `json:"resources"`
	Patches    []struct {
		Target struct {
			Kind string `json:"kind"`
			Name string `json:"name"`
		} `json:"target"`
		Patch string `json:"patch"`
	} `json:"patches,omitempty"`
	ConfigMapGenerator []struct {
		Name    string   `json:"name"`
		Files   []string `json:"files"`
		Options struct {
			Labels                map[string]string `json:"labels"`
			DisableNameSuffixHash bool              `json:"disableNameSuffixHash"`
		} `json:"options"`
	} `json:"configMapGenerator,omitempty"`
}

type podMonitor struct {
	APIVersion string            `json:"apiVersion"`
	Kind       string            `json:"kind"`
	Metadata   metav1.ObjectMeta `json:"metadata"`
	Spec       struct {
		Selector struct {
			MatchLabels map[string]string `json:"matchLabels"`
		} `json:"selector"`
		PodMetricsEndpoints []struct {
			Port        string       `json:"port"`
			Path        string       `json:"path"`
			Interval    string       `json:"interval"`
			Relabelings []relabeling `json:"relabelings"`
			// Of the chart's PodMonitor of a secure endpoint (metrics.secure).
			Scheme    string `json:"scheme"`
			TLSConfig *struct {
				InsecureSkipVerify bool `json:"insecureSkipVerify"`
			} `json:"tlsConfig"`
			Authorization *struct {
				Type        string                   `json:"type"`
				Credentials corev1.SecretKeySelector `json:"credentials"`
			} `json:"authorization"`
		} `json:"podMetricsEndpoints"`
	} `json:"spec"`
}

// relabeling is one of a PodMonitor's relabelings (Prometheus' relabel_config).
type relabeling struct {
	SourceLabels []string `json:"sourceLabels"`
	TargetLabel  string   `json:"targetLabel"`
	Regex        string   `json:"regex"`
	Replacement  string   `json:"replacement"`
}

// checkScrapeAddress checks that the relabelings make a pod's target address its IP (either
// family) with the metrics port, as Prometheus applies them: each regex anchored, matching the
// source label, replaced with $1 expanded.
func checkScrapeAddress(t *testing.T, rs []relabeling, port string) {
	t.Helper()
	for ip, want := range map[string]string{"172.30.0.2": "172.30.0.2:" + port, "fd00::2": "[fd00::2]:" + port} {
		addr := ip + ":1234" // the target's own address: a declared port's, or none's
		for _, r := range rs {
			if r.TargetLabel != "__address__" || !slices.Equal(r.SourceLabels, []string{"__meta_kubernetes_pod_ip"}) {
				continue
			}
			re := regexp.MustCompile("^(?:" + r.Regex + ")$")
			if m := re.FindStringSubmatchIndex(ip); m != nil {
				addr = string(re.ExpandString(nil, r.Replacement, ip, m))
			}
		}
		if addr != want {
			t.Errorf("a pod at %s is scraped at %s, want %s", ip, addr, want)
		}
	}
}

// prometheusRule is the Prometheus Operator's PrometheusRule: its groups are a Prometheus rule
// file, checked as promtool checks one (prometheusrule_test.go).
type prometheusRule struct {
	APIVersion string            `json:"apiVersion"`
	Kind       string            `json:"kind"`
	Metadata   metav1.ObjectMeta `json:"metadata"`
	Spec       struct {
		Groups []struct {
			Name  string `json:"name"`
			Rules []struct {
				Record      string            `json:"record,omitempty"`
				Alert       string            `json:"alert,omitempty"`
				Expr        string            `json:"expr"`
				For         string            `json:"for,omitempty"`
				Labels      map[string]string `json:"labels,omitempty"`
				Annotations map[string]string `json:"annotations,omitempty"`
			} `json:"rules"`
		} `json:"groups"`
	} `json:"spec"`
}

// ipMasqAgentConfig is an IPMasqAgentConfig: its spec is a configuration file's keys.
type ipMasqAgentConfig struct {
	APIVersion string            `json:"apiVersion"`
	Kind       string            `json:"kind"`
	Metadata   metav1.ObjectMeta `json:"metadata"`
	Spec       map[string]any    `json:"spec"`
}

type typeMeta struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
}

// manifests decodes every YAML file under deploy/ strictly; unknown fields fail the test.
func manifests(t *testing.T) map[string][]any {
	t.Helper()
	out := map[string][]any{}
	err := filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() && path == "helm" {
			return filepath.SkipDir // templates, not manifests: helm_test.go renders them
		}
		if err != nil || d.IsDir() || filepath.Ext(path) != ".yaml" {
			return err
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for i, doc := range bytes.Split(data, []byte("\n---\n")) {
			obj, err := decode(doc)
			if err != nil {
				return fmt.Errorf("%s doc %d: %w", path, i, err)
			}
			out[path] = append(out[path], obj)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// decode decodes one manifest strictly into its type; unknown fields and kinds are errors.
func decode(doc []byte) (any, error) {
	var tm typeMeta
	if err := yaml.Unmarshal(doc, &tm); err != nil {
		return nil, err
	}
	var obj any
	switch tm.APIVersion + "/" + tm.Kind {
	case "apps/v1/DaemonSet":
		obj = &appsv1.DaemonSet{}
	case "apps/v1/Deployment":
		obj = &appsv1.Deployment{}
	case "v1/ConfigMap":
		obj = &corev1.ConfigMap{}
	case "v1/Service":
		obj = &corev1.Service{}
	case "kustomize.config.k8s.io/v1beta1/Kustomization":
		obj = &kustomization{}
	case "monitoring.coreos.com/v1/PodMonitor":
		obj = &podMonitor{}
	case "monitoring.coreos.com/v1/PrometheusRule":
		obj = &prometheusRule{}
	case "v1/ServiceAccount":
		obj = &corev1.ServiceAccount{}
	case "v1/Secret":
		obj = &corev1.Secret{}
	case "apiextensions.k8s.io/v1/CustomResourceDefinition":
		obj = &apiextensionsv1.CustomResourceDefinition{}
	case "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy":
		obj = &admissionregistrationv1.ValidatingAdmissionPolicy{}
	case "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicyBinding":
		obj = &admissionregistrationv1.ValidatingAdmissionPolicyBinding{}
	case "rbac.authorization.k8s.io/v1/Role":
		obj = &rbacv1.Role{}
	case "rbac.authorization.k8s.io/v1/RoleBinding":
		obj = &rbacv1.RoleBinding{}
	case "rbac.authorization.k8s.io/v1/ClusterRole":
		obj = &rbacv1.ClusterRole{}
	case "rbac.authorization.k8s.io/v1/ClusterRoleBinding":
		obj = &rbacv1.ClusterRoleBinding{}
	case kube.Configs.APIVersion() + "/" + kube.Configs.Kind:
		obj = &ipMasqAgentConfig{}
	default:
		return nil, fmt.Errorf("unexpected kind %s %s", tm.APIVersion, tm.Kind)
	}
	if err := yaml.UnmarshalStrict(doc, obj); err != nil {
		return nil, err
	}
	return obj, nil
}

func one[T any](t *testing.T, all map[string][]any, path string) T {
	t.Helper()
	objs := all[path]
	if len(objs) != 1 {
		t.Fatalf("%s: %d documents, want 1", path, len(objs))
	}
	obj, ok := objs[0].(T)
	if !ok {
		t.Fatalf("%s: %T", path, objs[0])
	}
	return obj
}

func TestManifestsDecodeStrictly(t *testing.T) {
	all := manifests(t)
	if len(all) < 10 {
		t.Errorf("only %d manifest files found", len(all))
	}
	// Every kustomization resource exists.
	for path, objs := range all {
		k, ok := objs[0].(*kustomization)
		if !ok {
			continue
		}
		files := slices.Clone(k.Resources)
		for _, g := range k.ConfigMapGenerator {
			files = append(files, g.Files...)
		}
		for _, r := range files {
			if _, err := os.Stat(filepath.Join(filepath.Dir(path), r)); err != nil {
				t.Errorf("%s: %s: %v", path, r, err)
			}
		}
	}
}

// flagValue returns the value of --name=value in args.
func flagValue(t *testing.T, args []string, name string) string {
	t.Helper()
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v
		}
	}
	t.Fatalf("args %q have no --%s=", args, name)
	return ""
}

func TestDaemonSetInvariants(t *testing.T) {
	all := manifests(t)
	ds := one[*appsv1.DaemonSet](t, all, "base/daemonset.yaml")
	spec := ds.Spec.Template.Spec
	if !spec.HostNetwork {
		t.Error("hostNetwork must be true: the agent works on the node's uplink")
	}
	if spec.PriorityClassName != "system-node-critical" {
		t.Errorf("priorityClassName %q", spec.PriorityClassName)
	}
	if len(spec.Tolerations) != 1 || spec.Tolerations[0].Operator != corev1.TolerationOpExists || spec.Tolerations[0].Key != "" {
		t.Errorf("tolerations %+v: want one that tolerates every taint", spec.Tolerations)
	}
	ru := ds.Spec.UpdateStrategy.RollingUpdate
	if ds.Spec.UpdateStrategy.Type != appsv1.RollingUpdateDaemonSetStrategyType || ru == nil || ru.MaxSurge.IntValue() != 0 {
		t.Errorf("update strategy %+v: want a rolling update without surge (one agent per node)", ds.Spec.UpdateStrategy)
	}
	if len(spec.Containers) != 1 {
		t.Fatalf("%d containers", len(spec.Containers))
	}
	for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
		if sc := c.SecurityContext; sc == nil || (sc.Privileged != nil && *sc.Privileged) {
			t.Errorf("container %s is privileged (or has no securityContext)", c.Name)
		}
	}
	// seccomp: chosen here, not left to each kubelet's --seccomp-default; one profile for the
	// pod (docs/install.md, Seccomp, says which runtimes allow BPF under it).
	if psc := spec.SecurityContext; psc == nil || psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("pod securityContext %+v: want seccompProfile RuntimeDefault, explicitly", spec.SecurityContext)
	}
	for _, c := range spec.Containers {
		if c.SecurityContext.SeccompProfile != nil {
			t.Errorf("container %s overrides the pod's seccomp profile", c.Name)
		}
	}
	c := spec.Containers[0]
	volumes := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		volumes[v.Name] = v
	}
	mounts := map[string]corev1.VolumeMount{}
	for _, m := range c.VolumeMounts {
		mounts[m.Name] = m
		if _, ok := volumes[m.Name]; !ok {
			t.Errorf("mount %s has no volume", m.Name)
		}
	}

	// bpffs: the host's /sys/fs/bpf at the path --bpffs names, seeing the host's mounts.
	bpffs := flagValue(t, c.Args, "bpffs")
	if v := volumes["bpffs"]; v.HostPath == nil || v.HostPath.Path != "/sys/fs/bpf" {
		t.Errorf("bpffs volume %+v", v)
	}
	if m := mounts["bpffs"]; m.MountPath != bpffs || m.MountPropagation == nil || *m.MountPropagation != corev1.MountPropagationHostToContainer || m.ReadOnly {
		t.Errorf("bpffs mount %+v: want %s, HostToContainer, writable", m, bpffs)
	}

	// The config: the ConfigMap's key lands exactly where --config (and the default) points.
	cfgPath := flagValue(t, c.Args, "config")
	if cfgPath != config.DefaultPath {
		t.Errorf("--config=%s, the default is %s", cfgPath, config.DefaultPath)
	}
	cv := volumes["config"]
	if cv.ConfigMap == nil || cv.ConfigMap.Name != "ip-masq-agent" || len(cv.ConfigMap.Items) != 1 || cv.ConfigMap.Optional == nil || !*cv.ConfigMap.Optional {
		t.Fatalf("config volume %+v", cv)
	}
	if got := filepath.Join(mounts["config"].MountPath, cv.ConfigMap.Items[0].Path); got != cfgPath {
		t.Errorf("config mounted at %s, --config is %s", got, cfgPath)
	}
	base := one[*corev1.ConfigMap](t, all, "base/configmap.yaml")
	if _, ok := base.Data[cv.ConfigMap.Items[0].Key]; !ok {
		t.Errorf("the base ConfigMap has no key %q", cv.ConfigMap.Items[0].Key)
	}

	// Probes and the metrics port.
	_, port, err := net.SplitHostPort(flagValue(t, c.Args, "metrics-address"))
	if err != nil {
		t.Fatal(err)
	}
	// With hostNetwork a declared port is also a host port, and a host port keeps a surge
	// rollout's second pod off the node: the container declares none, and the probes, the
	// Service and the PodMonitor name the port by number.
	if len(c.Ports) != 0 {
		t.Errorf("ports %+v: a hostNetwork pod's port is a host port, which a surge rollout cannot place twice", c.Ports)
	}
	for name, probe := range map[string]*corev1.Probe{"/healthz": c.LivenessProbe, "/readyz": c.ReadinessProbe} {
		if probe == nil || probe.HTTPGet == nil || probe.HTTPGet.Path != name || probe.HTTPGet.Port.String() != port {
			t.Errorf("probe for %s: %+v, want port %s", name, probe, port)
		}
	}
	// Started once this container's agent holds the node lock: the image's binary says.
	if p := c.StartupProbe; p == nil || p.Exec == nil || !slices.Equal(p.Exec.Command, []string{image.Runtime.Binary, "holder", "--mine"}) {
		t.Errorf("startup probe %+v, want %s holder --mine", p, image.Runtime.Binary)
	}
	svc := one[*corev1.Service](t, all, "base/service.yaml")
	if len(svc.Spec.Ports) != 1 || fmt.Sprint(svc.Spec.Ports[0].Port) != port || svc.Spec.Ports[0].TargetPort.String() != port {
		t.Errorf("service ports %+v", svc.Spec.Ports)
	}
	pm := one[*podMonitor](t, all, "monitoring/podmonitor.yaml")
	if len(pm.Spec.PodMetricsEndpoints) != 1 || pm.Spec.PodMetricsEndpoints[0].Port != "" || pm.Spec.PodMetricsEndpoints[0].Path != "/metrics" {
		t.Errorf("pod monitor endpoints %+v", pm.Spec.PodMetricsEndpoints)
	} else {
		checkScrapeAddress(t, pm.Spec.PodMetricsEndpoints[0].Relabelings, port)
	}

	// The rollout order: the pod's template generation, from the label the DaemonSet controller
	// gives its pods, reaches --template-generation.
	if got := flagValue(t, c.Args, "template-generation"); got != "$(POD_TEMPLATE_GENERATION)" {
		t.Errorf("--template-generation=%s, want $(POD_TEMPLATE_GENERATION)", got)
	}
	if i := slices.IndexFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == "POD_TEMPLATE_GENERATION" }); i < 0 ||
		c.Env[i].ValueFrom == nil || c.Env[i].ValueFrom.FieldRef == nil || c.Env[i].ValueFrom.FieldRef.FieldPath != "metadata.labels['pod-template-generation']" {
		t.Errorf("env %+v: want POD_TEMPLATE_GENERATION from the pod-template-generation label", c.Env)
	}
	for _, sel := range []map[string]string{pm.Spec.Selector.MatchLabels, svc.Spec.Selector, ds.Spec.Selector.MatchLabels} {
		if len(sel) == 0 {
			t.Error("an empty selector selects every pod, not the agent's")
		}
		for k, v := range sel {
			if ds.Spec.Template.Labels[k] != v {
				t.Errorf("selector %v does not select the agent's pods %v", sel, ds.Spec.Template.Labels)
			}
		}
	}

	// Resources: requests and a memory limit.
	if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Memory().IsZero() {
		t.Errorf("resources %+v", c.Resources)
	}

	// Capabilities: all dropped, a few added back, each with a comment saying why.
	sc := c.SecurityContext
	if sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("capabilities %+v: want drop ALL", sc.Capabilities)
	}
	if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		t.Error("allowPrivilegeEscalation must be false")
	}
	raw, err := os.ReadFile("base/daemonset.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, capability := range sc.Capabilities.Add {
		re := regexp.MustCompile(`#\s*` + string(capability) + `:.*\n(\s*#.*\n)*\s*- ` + string(capability) + `\n`)
		if !re.Match(raw) {
			t.Errorf("capability %s has no comment saying why it is needed", capability)
		}
	}
	// The set test/e2e's TestDaemonSetCapabilitiesAreEnough proves enough, each one necessary.
	if want := []corev1.Capability{"NET_ADMIN", "BPF", "PERFMON", "NET_RAW"}; !slices.Equal(sc.Capabilities.Add, want) {
		t.Errorf("the manifest adds %v, want %v", sc.Capabilities.Add, want)
	}
}

// The handbook overlay adds the masq-agent-ds-ready node selector to the base DaemonSet.
func TestReadyLabelOverlay(t *testing.T) {
	all := manifests(t)
	k := one[*kustomization](t, all, "overlays/masq-agent-ds-ready/kustomization.yaml")
	if len(k.Patches) != 1 || k.Patches[0].Target.Kind != "DaemonSet" || k.Patches[0].Target.Name != "ip-masq-agent" {
		t.Fatalf("patches %+v", k.Patches)
	}
	var ops []struct {
		Op    string `json:"op"`
		Path  string `json:"path"`
		Value string `json:"value"`
	}
	if err := yaml.UnmarshalStrict([]byte(k.Patches[0].Patch), &ops); err != nil {
		t.Fatal(err)
	}
	ds := one[*appsv1.DaemonSet](t, all, "base/daemonset.yaml")
	const prefix = "/spec/template/spec/nodeSelector/"
	if len(ops) != 1 || ops[0].Op != "add" || !strings.HasPrefix(ops[0].Path, prefix) {
		t.Fatalf("patch %+v", ops)
	}
	// A JSON-patch "add" below nodeSelector needs nodeSelector to exist in the base.
	if ds.Spec.Template.Spec.NodeSelector == nil {
		t.Fatal("the base DaemonSet has no nodeSelector for the overlay to add to")
	}
	key := strings.NewReplacer("~1", "/", "~0", "~").Replace(strings.TrimPrefix(ops[0].Path, prefix))
	if key != "beta.kubernetes.io/masq-agent-ds-ready" || ops[0].Value != "true" {
		t.Errorf("overlay selects %s=%s", key, ops[0].Value)
	}
}

// Each ConfigMap example parses and validates, equals the seed scenario's config that the
// golden chain tests use, and gives the seed's verdicts for the seed's addresses.
func TestConfigMapExamples(t *testing.T) {
	all := manifests(t)
	type verdict struct {
		addr   string
		action policy.Action
	}
	M, R := policy.Masquerade, policy.Return
	// A source rule's verdict: traffic from src to dst.
	type fromVerdict struct {
		src, dst string
		action   policy.Action
	}
	examples := map[string]struct {
		seed     string // config in pkg/iptables/testdata/seeds, "" for the defaults
		verdicts []verdict
	}{
		"examples/configmap-defaults.yaml": {"", []verdict{
			{"10.1.2.3", R}, {"172.16.0.1", R}, {"192.168.1.1", R}, {"169.254.169.254", R}, {"8.8.8.8", M}, {"100.64.0.1", M},
		}},
		"base/configmap.yaml": {"", []verdict{{"10.1.2.3", R}, {"8.8.8.8", M}}},
		"examples/configmap-pod-identity.yaml": {"cce-pod-identity.yaml", []verdict{
			{"10.1.2.3", R}, {"172.16.0.1", R}, {"100.64.230.9", R}, {"192.168.1.1", R}, {"169.254.169.254", R},
			{"8.8.8.8", R}, // masqOutBound: false: the pod exits with its own address
			{"fd00::1", R}, {"2001:4860:4860::8888", M},
		}},
		"examples/configmap-node-identity.yaml": {"cce-node-identity.yaml", []verdict{
			{"10.1.2.3", R}, {"172.16.0.1", R}, {"100.64.230.9", R}, {"100.64.231.9", M}, {"8.8.8.8", M},
			{"fd00::1", R}, {"2001:4860:4860::8888", M},
		}},
		"examples/configmap-some-destinations.yaml": {"cce-some-destinations.yaml", []verdict{
			{"10.10.10.10", M}, // the service VIP that accepts only node addresses
			{"10.10.10.11", R}, {"172.16.0.1", R}, {"8.8.8.8", R}, {"fd00::1", R}, {"2001:4860:4860::8888", M},
		}},
		"examples/configmap-masquerade-address.yaml": {"", []verdict{
			{"203.0.113.7", M}, {"8.8.8.8", M}, {"10.1.2.3", R},
		}},
		// The defaults as an IPMasqAgentConfig (--config-source=crd): its spec is the file.
		"examples/ipmasqagentconfig-defaults.yaml": {"", []verdict{
			{"10.1.2.3", R}, {"169.254.169.254", R}, {"8.8.8.8", M},
		}},
		// A pod that no rule matches is decided by the defaults (fromSources has the others).
		"examples/ipmasqagentconfig-source-rules.yaml": {"", []verdict{
			{"10.1.2.3", R}, {"198.51.100.7", M}, {"8.8.8.8", M},
		}},
		"examples/configmap-user.yaml": {"", []verdict{
			{"100.64.1.1", R}, {"10.10.10.10", M}, // the user's
			{"10.1.2.3", R}, {"192.168.1.1", R}, {"8.8.8.8", M}, // the platform's
		}},
	}
	// With source rules: the pods the selectors choose (by rule name), and the verdicts of
	// traffic from them and from the rules' CIDRs. The partner's pods keep their addresses
	// toward its network, pool B's everywhere.
	fromSources := map[string]struct {
		pods map[string][]netip.Addr
		from []fromVerdict
	}{"examples/ipmasqagentconfig-source-rules.yaml": {map[string][]netip.Addr{"partner": {netip.MustParseAddr("10.244.1.5")}}, []fromVerdict{
		{"10.244.1.5", "198.51.100.7", R}, {"10.244.1.5", "10.1.2.3", R}, {"10.244.1.5", "8.8.8.8", M},
		{"10.244.130.9", "8.8.8.8", R}, {"10.244.130.9", "198.51.100.7", R},
		{"10.244.1.6", "198.51.100.7", M}, {"10.244.1.6", "8.8.8.8", M}, // in no rule: as the global keys
	}}}
	// Where masqueraded traffic leaves from, by example and destination.
	sources := map[string]map[string]netip.Addr{"examples/configmap-masquerade-address.yaml": {
		"203.0.113.7": netip.MustParseAddr("10.0.0.11"), // the partner's
		"8.8.8.8":     {},                               // the uplink's primary address
	}}
	// A user's example is merged with the platform's ConfigMap, as the config-directory overlay
	// projects them; its seed then says nothing.
	mergedWith := map[string]string{"examples/configmap-user.yaml": "base/configmap.yaml"}
	for path, ex := range examples {
		t.Run(path, func(t *testing.T) {
			opts := config.Options{EnableIPv6: true}
			doc, cm := exampleConfig(t, all[path])
			cfg, err := config.Parse(doc, opts)
			if err != nil {
				t.Fatal(err)
			}
			want := config.Default(opts)
			if ex.seed != "" {
				if want, err = config.Load(filepath.Join("..", "pkg", "iptables", "testdata", "seeds", ex.seed), opts); err != nil {
					t.Fatal(err)
				}
			}
			global := cfg
			global.SourceRules = nil
			if platform, ok := mergedWith[path]; ok {
				cfg = projected(t, one[*corev1.ConfigMap](t, all, platform), cm)
			} else if _, ok := sources[path]; !ok && !bytes.Equal(global.Canonical(), want.Canonical()) {
				t.Errorf("config %s\nwant     %s", global.Canonical(), want.Canonical())
			}
			fs, ok := fromSources[path]
			if len(cfg.SourceRules) > 0 && !ok {
				t.Errorf("source rules %v, and no verdict from a source", cfg.SourceRules)
			}
			p := policy.Compile(cfg, policy.Options{EnableIPv6: true, Pods: fs.pods})
			for _, v := range fs.from {
				if got := p.DecideFrom(netip.MustParseAddr(v.src), netip.MustParseAddr(v.dst)); got.Action != v.action {
					t.Errorf("from %s to %s: %v, want %v", v.src, v.dst, got.Action, v.action)
				}
			}
			for _, v := range ex.verdicts {
				if got := p.Decide(netip.MustParseAddr(v.addr)); got.Action != v.action {
					t.Errorf("%s: %v, want %v", v.addr, got.Action, v.action)
				}
			}
			for dst, want := range sources[path] {
				if got := p.Decide(netip.MustParseAddr(dst)); got.Rule == nil || got.Rule.Address != want {
					t.Errorf("%s leaves from %+v, want %v", dst, got.Rule, want)
				}
			}
		})
	}
	// Every example is covered above.
	matches, _ := filepath.Glob("examples/*.yaml")
	for _, m := range matches {
		if _, ok := examples[m]; !ok {
			t.Errorf("example %s is not checked", m)
		}
	}
}

// exampleConfig is the configuration an example holds: a ConfigMap's config key, or an
// IPMasqAgentConfig's spec (as the agent reads it, in JSON); and the ConfigMap, nil for the other.
func exampleConfig(t *testing.T, objs []any) ([]byte, *corev1.ConfigMap) {
	t.Helper()
	if len(objs) != 1 {
		t.Fatalf("%d documents, want 1", len(objs))
	}
	switch o := objs[0].(type) {
	case *corev1.ConfigMap:
		return []byte(o.Data[kube.ConfigMapKey]), o
	case *ipMasqAgentConfig:
		doc, err := json.Marshal(o.Spec)
		if err != nil {
			t.Fatal(err)
		}
		return doc, nil
	}
	t.Fatalf("an example of kind %T", objs[0])
	return nil, nil
}

// projected merges ConfigMaps as the agent does when the config-directory overlay projects them
// into its config directory: the volume's items name the files, --config names the directory.
func projected(t *testing.T, cms ...*corev1.ConfigMap) config.Config {
	t.Helper()
	ds := one[*appsv1.DaemonSet](t, kustomizeTyped(t, "overlays/config-directory"), "DaemonSet ip-masq-agent")
	spec := ds.Spec.Template.Spec
	mount := spec.Containers[0].VolumeMounts[0]
	if got := flagValue(t, spec.Containers[0].Args, "config"); got != mount.MountPath || spec.Volumes[0].Name != mount.Name {
		t.Fatalf("--config=%s, the config volume mounted at %s: the agent must be given the directory", got, mount.MountPath)
	}
	dir := t.TempDir()
	var written int
	for _, src := range spec.Volumes[0].Projected.Sources {
		for _, cm := range cms {
			if src.ConfigMap.Name != cm.Name {
				continue
			}
			for _, item := range src.ConfigMap.Items {
				if ok, _ := filepath.Match(config.DefaultPattern, item.Path); !ok {
					t.Errorf("ConfigMap %s is projected as %s, which the agent's %s leaves out", cm.Name, item.Path, config.DefaultPattern)
				}
				if err := os.WriteFile(filepath.Join(dir, item.Path), []byte(cm.Data[item.Key]), 0o644); err != nil {
					t.Fatal(err)
				}
				written++
			}
		}
	}
	if written != len(cms) {
		t.Fatalf("the overlay projects %d of the ConfigMaps %d", written, len(cms))
	}
	cfg, err := config.Load(dir, config.Options{EnableIPv6: true})
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// kustomizeTyped builds a kustomization and decodes each object strictly, keyed "Kind name".
func kustomizeTyped(t *testing.T, dir string) map[string][]any {
	t.Helper()
	out := map[string][]any{}
	for _, o := range kustomize(t, dir) {
		doc, err := yaml.Marshal(o)
		if err != nil {
			t.Fatal(err)
		}
		obj, err := decode(doc)
		if err != nil {
			t.Fatal(err)
		}
		meta, _ := o["metadata"].(map[string]any)
		k := fmt.Sprintf("%v %v", o["kind"], meta["name"])
		out[k] = append(out[k], obj)
	}
	return out
}

// The dashboard's panels have ids of their own: Grafana keys a panel's links and state by it.
func TestDashboardPanelIDs(t *testing.T) {
	data, err := os.ReadFile("monitoring/grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			ID    int    `json:"id"`
			Title string `json:"title"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		t.Fatal(err)
	}
	seen := map[int]string{}
	for _, p := range dash.Panels {
		if other, ok := seen[p.ID]; ok {
			t.Errorf("panels %q and %q share the id %d", other, p.Title, p.ID)
		}
		seen[p.ID] = p.Title
	}
}

// Every metric the Grafana dashboard queries is one the agent exports, grouped only by labels it
// has (or the target labels the PodMonitor adds), and filtered only on label values it emits.
func TestDashboardQueriesExportedMetrics(t *testing.T) {
	data, err := os.ReadFile("monitoring/grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Type    string `json:"type"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Name  string `json:"name"`
				Query any    `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		t.Fatal(err)
	}
	defs := map[string]metrics.Definition{}
	for _, d := range metrics.Definitions(nil) {
		defs[d.Name] = d
	}
	// The PodMonitor's relabeling adds node; Prometheus adds job, instance, pod and namespace.
	targetLabels := []string{"node", "job", "instance", "pod", "namespace"}
	labelValues := map[string][]string{
		"result": {metrics.ReloadSuccess, metrics.ReloadInvalid, metrics.ReloadApplyError},
		"source": {metrics.SourceRules, metrics.SourceNAT, metrics.SourceHooks},
	}
	nameRE := regexp.MustCompile(`ip_masq_agent_[a-z0-9_]+`)
	byRE := regexp.MustCompile(`by \(([^)]*)\)`)
	matcherRE := regexp.MustCompile(`([a-z_]+)\s*=~?\s*"([^"$]*)"`)
	var exprs []string
	queried := 0
	for _, p := range dash.Panels {
		if p.Type != "row" && len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			exprs = append(exprs, tg.Expr)
		}
	}
	for _, v := range dash.Templating.List {
		if q, ok := v.Query.(map[string]any); ok {
			exprs = append(exprs, fmt.Sprint(q["query"]))
		}
	}
	for _, expr := range exprs {
		var labels []string
		for _, name := range nameRE.FindAllString(expr, -1) {
			base := name
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				if b, ok := strings.CutSuffix(name, suffix); ok && defs[b].Type == "histogram" {
					base = b
					if suffix == "_bucket" {
						labels = append(labels, "le")
					}
				}
			}
			d, ok := defs[base]
			if !ok {
				t.Errorf("%q queries %s, which the agent does not export", expr, name)
				continue
			}
			queried++
			labels = append(labels, d.Labels...)
		}
		for _, m := range byRE.FindAllStringSubmatch(expr, -1) {
			for _, l := range strings.Split(m[1], ",") {
				if l = strings.TrimSpace(l); !slices.Contains(labels, l) && !slices.Contains(targetLabels, l) {
					t.Errorf("%q groups by %s, which its metrics do not have", expr, l)
				}
			}
		}
		for _, m := range matcherRE.FindAllStringSubmatch(expr, -1) {
			if vals, ok := labelValues[m[1]]; ok && !slices.Contains(vals, m[2]) {
				t.Errorf("%q filters %s=%q, a value the agent never emits", expr, m[1], m[2])
			}
		}
	}
	if queried < 10 {
		t.Errorf("only %d metric references found; is the dashboard parsed?", queried)
	}
	// Every agent metric appears on the dashboard.
	for name := range defs {
		if !strings.Contains(string(data), name) {
			t.Errorf("the dashboard does not show %s", name)
		}
	}
}

// The uninstall DaemonSet runs `cleanup` with what the agent used (bpffs, chain) and the same
// capabilities, so it can remove whatever the agent installed.
func TestCleanupDaemonSet(t *testing.T) {
	all := manifests(t)
	agentPod := one[*appsv1.DaemonSet](t, all, "base/daemonset.yaml").Spec.Template.Spec
	agent := agentPod.Containers[0]
	ds := one[*appsv1.DaemonSet](t, all, "cleanup/daemonset.yaml")
	spec := ds.Spec.Template.Spec
	if !reflect.DeepEqual(spec.SecurityContext, agentPod.SecurityContext) {
		t.Errorf("pod securityContext %+v, the agent's is %+v: cleanup needs bpf(2) as the agent does", spec.SecurityContext, agentPod.SecurityContext)
	}
	for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
		if c.SecurityContext.SeccompProfile != nil {
			t.Errorf("container %s overrides the pod's seccomp profile", c.Name)
		}
	}
	if !spec.HostNetwork || len(spec.InitContainers) != 1 {
		t.Fatalf("cleanup DaemonSet: hostNetwork %v, %d init containers", spec.HostNetwork, len(spec.InitContainers))
	}
	c := spec.InitContainers[0]
	if len(c.Args) == 0 || c.Args[0] != "cleanup" {
		t.Errorf("args %q: want the cleanup subcommand", c.Args)
	}
	for _, f := range []string{"bpffs", "masq-chain"} {
		if got, want := flagValue(t, c.Args[1:], f), flagValue(t, agent.Args, f); got != want {
			t.Errorf("--%s=%s, the agent uses %s", f, got, want)
		}
	}
	if c.Image != agent.Image {
		t.Errorf("image %s, the agent's is %s", c.Image, agent.Image)
	}
	if !slices.Equal(c.SecurityContext.Capabilities.Add, agent.SecurityContext.Capabilities.Add) {
		t.Errorf("capabilities %v, the agent has %v", c.SecurityContext.Capabilities.Add, agent.SecurityContext.Capabilities.Add)
	}
	mounted := false
	for _, m := range c.VolumeMounts {
		if m.MountPath == flagValue(t, agent.Args, "bpffs") {
			mounted = true
		}
	}
	if !mounted {
		t.Error("the cleanup container does not mount the BPF filesystem")
	}
}
