{{- define "rljob.fullname" -}}
{{- printf "%s-rljob-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rljob.serviceAccountName" -}}
{{- default (include "rljob.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "rljob.labels" -}}
app.kubernetes.io/name: rljob-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "rljob.selectorLabels" -}}
app.kubernetes.io/name: rljob-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rljob.webhookSecret" -}}
{{- printf "%s-webhook-tls" (include "rljob.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- /* The namespaces of rbac.scope namespaced, as a JSON list (default: the release's namespace). */}}
{{- define "rljob.namespaces" -}}
{{- .Values.rbac.namespaces | default (list .Release.Namespace) | toJson -}}
{{- end -}}

{{- /*
The webhook's serving certificate (and its CA), as JSON {cert, key, ca} (base64 PEM). Generated once per
render and shared by the Secret and the Deployment's checksum annotation (Helm gives every template of a
chart the same .Values, so the first include stores it there). On `helm upgrade` the certificate in the
existing Secret is kept (lookup): the operator keeps serving with the certificate the API server trusts. A
new certificate (first install, the Secret deleted, webhook.rotateCertificate=true) changes the checksum
annotation, so the Deployment rolls and the operator loads it (kopf reads its certificate only at start).
*/}}
{{- define "rljob.webhookCert" -}}
{{- if not (hasKey .Values "webhookCertificate_") -}}
{{- $svc := include "rljob.fullname" . -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "rljob.webhookSecret" .) -}}
{{- $data := dig "data" (dict) ($existing | default (dict)) -}}
{{- if and (hasKey $data "tls.crt") (hasKey $data "tls.key") (hasKey $data "ca.crt") (not .Values.webhook.rotateCertificate) -}}
{{- $_ := set .Values "webhookCertificate_" (dict "cert" (index $data "tls.crt") "key" (index $data "tls.key") "ca" (index $data "ca.crt")) -}}
{{- else -}}
{{- $dns := list $svc (printf "%s.%s" $svc .Release.Namespace) (printf "%s.%s.svc" $svc .Release.Namespace) (printf "%s.%s.svc.cluster.local" $svc .Release.Namespace) -}}
{{- $ca := genCA (printf "%s-ca" $svc) 3650 -}}
{{- $cert := genSignedCert (printf "%s.%s.svc" $svc .Release.Namespace) nil $dns 3650 $ca -}}
{{- $_ := set .Values "webhookCertificate_" (dict "cert" ($cert.Cert | b64enc) "key" ($cert.Key | b64enc) "ca" ($ca.Cert | b64enc)) -}}
{{- end -}}
{{- end -}}
{{- toJson (get .Values "webhookCertificate_") -}}
{{- end -}}

{{- /* Whether the webhook's certificate is the chart's (an in-cluster webhook behind the Service). */}}
{{- define "rljob.chartCert" -}}
{{- if and .Values.webhook.enabled (not .Values.webhook.url) }}true{{ end -}}
{{- end -}}
